"""The HTML page toolkit both reports use (the ladder's, report/ladder.py, and the probes',
report/probes.py): escaping, numbers from JSON, matplotlib figures embedded as
PNG data URIs, key-value tables, the environment section and the shared CSS."""

from __future__ import annotations

import base64
import html
import io
import math
import platform
from importlib.metadata import version


def escape(x) -> str:
    """x as HTML text (None as empty)."""
    return html.escape("" if x is None else str(x), quote=True)


def number(x) -> float:
    """A float from a JSON value; 'nan'/'inf' strings, None and junk become floats/NaN."""
    if x is None:
        return math.nan
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def png(fig) -> str:
    """A matplotlib figure as a data: URI (the figure is closed)."""
    import matplotlib.pyplot as plt  # matplotlib: slow import; the figure came from pyplot() (Agg)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    # matplotlib: slow import, and the backend must be chosen before pyplot loads
    import matplotlib
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt
    return plt


def figure(alt: str, plot, *args) -> str:
    """A plot (`plot(*args)` -> (data URI or None, caption)) and its caption as HTML; a
    failing plot becomes its caption: a plot must never cost the page."""
    try:
        img, cap = plot(*args)
    except Exception as exc:  # noqa: BLE001
        img, cap = None, f"plot failed: {type(exc).__name__}: {exc}"
    return (f"<img alt='{escape(alt)}' src='{img}'>" if img else "") + f"<p class='cap'>{escape(cap)}</p>"


def kv_table(d: dict) -> str:
    """A two-column HTML table of a dict."""
    if not d:
        return "<p>(none)</p>"
    rows = "".join(f"<tr><th>{escape(k)}</th><td><code>{escape(v)}</code></td></tr>" for k, v in d.items())
    return f"<table>{rows}</table>"


def environment_section(report: dict) -> tuple[str, dict]:
    """(where it comes from, the run environment): the report's record, else the versions
    installed where the page is rendered."""
    env = report.get("environment")
    if env:
        if isinstance(env, dict):
            return "from the report", env
        return "from the report", {"environment": env}
    found = {"python": platform.python_version()}
    for pkg in ("numpy", "torch", "jax", "jaxlib", "ml_dtypes", "transformers", "matplotlib"):
        try:
            found[pkg] = version(pkg)
        except Exception:
            found[pkg] = "not installed"
    return "not recorded in the report; versions installed where this page was rendered", found


GENERATOR = "llama-parity"   # <meta name='generator'>: how the CLI knows a page it may overwrite


def head(title: str) -> str:
    """The page's opening up to <body>: charset, title, generator, the shared CSS."""
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
            f"<meta name='generator' content='{GENERATOR}'><title>{escape(title)}</title>"
            f"<style>{CSS}</style></head><body>")


CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Helvetica,Arial,sans-serif;margin:24px auto;
max-width:1100px;color:#222;line-height:1.4;padding:0 16px}
h1{font-size:22px;margin:0 0 6px} h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.badge{display:inline-block;color:#fff;font-size:30px;font-weight:700;padding:8px 22px;
border-radius:10px;letter-spacing:1px;text-transform:uppercase}
.head{display:flex;gap:20px;align-items:center}
.sub{font-size:16px;color:#444}
.div{margin:14px 0;padding:10px 14px;border-left:5px solid;background:#fafafa}
.ok{margin:14px 0;padding:10px 14px;border-left:5px solid #2e9d3a;background:#f3faf3}
table{border-collapse:collapse;font-size:12.5px;margin:6px 0}
th,td{border:1px solid #ddd;padding:3px 7px;text-align:left;vertical-align:top}
th{background:#f0f0f0} td.n{font-family:ui-monospace,Menlo,Consolas,monospace;text-align:right;
white-space:nowrap} td.k{color:#fff;font-weight:600} td.t{font-family:ui-monospace,Menlo,Consolas,
monospace;white-space:nowrap}
img{max-width:100%} .cap{font-size:13px;color:#555;margin:2px 0 10px}
details summary{cursor:pointer;margin:8px 0;font-weight:600}
code{font-family:ui-monospace,Menlo,Consolas,monospace}
"""
