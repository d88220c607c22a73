"""Settings for the fairness drill's hosts: the scale-out drill's, the fair order chosen
by ``FAIR_DRILL_FAIR_SHARE`` (the drill's ``--compare`` runs the hosts without it)."""

import os

from tests.chaos.scaleout_settings import *  # noqa: F403

JOBS_FAIR_SHARE = os.environ.get("FAIR_DRILL_FAIR_SHARE", "1") == "1"
