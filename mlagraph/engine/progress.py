"""Progress messages for the slow, silent parts: compiling a step, capturing CUDA graphs.

tqdm on stderr, shown only when stderr is a terminal unless told otherwise (``progress=True``
forces it, ``False`` silences it), so logs and CI output stay clean.
"""

from __future__ import annotations

import contextlib
import sys


def enabled(progress: bool | None) -> bool:
    """``progress`` as given, or (None) whether stderr is a terminal."""
    if progress is None:
        return bool(getattr(sys.stderr, "isatty", lambda: False)())
    return bool(progress)


class CompileProgress:
    """Says when a compiled step meets a batch-plan variant it has not compiled yet (the first
    step of that kind compiles its graph: a minute or more on a CPU), and how long it took."""

    def __init__(self, progress: bool | None):
        self.enabled = enabled(progress)
        self.seen: set = set()

    @contextlib.contextmanager
    def step(self, key, label: str):
        """Wraps one step; ``key`` names its graph variant, ``label`` describes it."""
        if key in self.seen:
            yield
            return
        self.seen.add(key)
        if not self.enabled:
            yield
            return
        from tqdm.auto import tqdm

        with tqdm(total=1, desc=f"compiling the {label} step", bar_format="{desc}: {elapsed}", leave=True) as bar:
            yield
            bar.set_description_str(f"compiled the {label} step")
            bar.update(1)
