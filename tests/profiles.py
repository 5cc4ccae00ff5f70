"""Where the tests find PipeDream's published profiles: vendored in examples/pipedream (MIT)."""
from pathlib import Path

PROFILES = Path(__file__).resolve().parents[1] / "examples" / "pipedream"
