"""The records of the measuring commands (gap, invariance, recalibrate), their prose
diagnoses, and the definitions of the statistics they report.

Torch-free at import (tests/test_architecture.py pins it): `bnaudit.output` renders these
records, and the modules of `bnaudit.runtime` fill them.
"""
