"""``inverted view``'s flags."""

from __future__ import annotations

from dataclasses import dataclass

from inverted.config import (
    option,
    require,
)


@dataclass(kw_only=True, slots=True)
class ViewConfig:
    """``inverted view``: a read-only web app over a job's output directory (runs, Samples, trajectories)."""

    run_dir: str = option(
        "", "a job's output directory (--output-dir: buffer.db, metrics.jsonl)", path=True, positional=True
    )
    host: str = option("127.0.0.1", "address to bind")
    port: int = option(8787, "port to bind")
    api_key: str | None = option(
        None,
        "require this key (open the printed address once with ?key=KEY; default: the run's own, derived from "
        "the job's key in RUN_DIR/services)",
    )
    tokenizer: str | None = option(None, "where the token texts come from (default: the run's checkpoint)", path=True)

    def __post_init__(self) -> None:
        require(bool(self.run_dir), "RUN_DIR", self.run_dir, "a job's output directory")
        require(1 <= self.port <= 65535, "--port", self.port, "1..65535")
