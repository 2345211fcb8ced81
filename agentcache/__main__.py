"""``python -m agentcache`` runs the command line."""

from __future__ import annotations

import sys

from agentcache.cli import main

sys.exit(main())
