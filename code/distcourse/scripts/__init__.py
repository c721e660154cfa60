"""Small standalone scripts, run as ``python -m distcourse.scripts.<name>``.

They start their own processes (``mp.spawn``, ``torchrun``), so they must be
real files: functions defined in a notebook cannot be pickled under ``spawn``.
"""
