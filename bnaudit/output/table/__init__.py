"""Rich tables for the terminal: one renderer module per report kind (inspect, diff, fold, gap,
invariance, recalibrate), the rules listing, and what they share (`common`). Which renderer
draws a report is decided with every other format in `bnaudit.output.EMITTERS`.
"""
