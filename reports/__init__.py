"""reports: the command line and everything a person sees (rich tables, charts, plots, exports).

It computes nothing itself: it calls ``diagnostics`` and ``props`` and draws.
"""
