"""Statistics bnaudit reports, each defined once (torch-free).

For one BN layer with channels c = 1..C, mu_d, var_d the mean and unbiased variance of
the data reaching the layer (`bnaudit.runtime.stats`), and mu_r, var_r its running
statistics:

  shift_c        |mu_d - mu_r| / sqrt(var_r + eps)       (in running standard deviations)
  log_var_c      |log((var_d + eps) / (var_r + eps))|     (0: the variances agree)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Drift:
    """How far running statistics (mu_r, var_r) are from the statistics of the data
    that reaches the layer (mu_d, var_d: module docstring):

      mean_shift      mean over channels of shift_c
      max_mean_shift  max over channels of shift_c
      var_log_ratio   mean over channels of log_var_c

    All three are 0 when the stored statistics describe the data exactly. None where
    a value is not finite (a NaN or negative running_var). Used by gap (running
    statistics against evaluation data) and recalibrate (old and new statistics
    against calibration data).
    """

    mean_shift: float | None
    max_mean_shift: float | None
    var_log_ratio: float | None
