"""Checkpoint interval advice (`GET /v1/runs/{run}/advice`): Young's and Daly's
optimum interval from a run's observed checkpoint costs."""
