"""Domain names shared by data, rewards and metrics (no torch: config code imports this)."""

from __future__ import annotations

# The domain a single-dataset run (no `domains:` section) is made of; its metrics carry no domain name.
DEFAULT_DOMAIN = "default"
