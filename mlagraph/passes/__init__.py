"""FX graph passes for torch.compile: fusion, concat elimination, lints, reports, the printer.

Public names (outside checks use them):

- passes: :func:`fuse_rope_concat_cache`, :func:`eliminate_concat`
- lints: :func:`lint_rope_once`, :func:`lint_write_once`, :func:`lint_backend_ops`
- :func:`reports` / :func:`last_report`: ``PassRecord(graph, pass_name, layer, count)`` of
  every compile in this process (newest last) / of the newest compile
- :func:`render`: the canonical graph text used by golden tests
- :class:`MLAPassManager`: the Inductor ``CustomGraphPass`` running all of the above
"""

from .fusion import eliminate_concat, fuse_rope_concat_cache  # noqa: F401
from .lints import LintError, lint_backend_ops, lint_rope_once, lint_write_once  # noqa: F401
from .manager import (  # noqa: F401
    CompileReport,
    FusionNotApplied,
    MLAPassManager,
    PassRecord,
    clear_reports,
    last_compile,
    last_report,
    reports,
)
from .render import render  # noqa: F401
