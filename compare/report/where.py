"""Reports for `probe where` (compare.probes.where.WhereResult): the terminal table per layer
and component, JSON, and a self-contained HTML page on the page toolkit (report/page.py)
with the per-tap A-vs-B difference against depth inside the float64-twin drift envelope.

Everything here renders a result's dict (WhereResult.to_dict(), or the JSON read back);
the sentences come from compare.probes.where_text, through the dict's hint/explanation.
"""

from __future__ import annotations

import math
from pathlib import Path

from llamaspec.files import atomic_write, json_text

from ..vocabulary import KIND_ANSI, KINDS, kind_hex
from .page import environment_section, escape, figure, head, kv_table, number, png, pyplot

LOG_CLIP = 1e-18     # zeros are drawn here on the log axes
MAX_LINES = 8        # comparisons drawn in the all-comparisons plot


def _as_dict(r) -> dict:
    return r if isinstance(r, dict) else r.to_dict()


def _f(x, spec=".1e") -> str:
    v = number(x)
    return "nan" if math.isnan(v) else format(v, spec)


def _kind_index(k) -> int:
    return KINDS.index(k) if k in KINDS else len(KINDS)


def worst(d: dict) -> dict:
    """The comparison with the worst verdict (then: one that goes beyond drift, then the
    earliest first difference), as WhereResult.worst picks it."""
    def key(c):
        fd = c.get("first_difference")
        taps = [t["tap"] for t in c.get("taps", [])]
        depth = -len(taps) if fd is None else -taps.index(fd["tap"])
        return (_kind_index(c.get("verdict")), c.get("first_beyond") is not None, depth)
    return max(d["comparisons"], key=key)


def _ratio(t: dict) -> float:
    """The judge's err_b / bound (the worst of the whole tap and its quarters); a result saved
    before the probe recorded it: err_b / bound over the whole tap."""
    if t.get("ratio") is not None:
        return number(t["ratio"])
    eb, b = number(t.get("err_b")), number(t.get("bound"))
    return eb / b if b > 0 else (0.0 if eb == 0 else math.inf)


def component_rows(c: dict) -> list[dict]:
    """One row per (layer, component) in execution order: worst kind, taps bitwise equal,
    the largest ULP, relative difference, err_b / bound (the working rung) and the twin's
    B-vs-A difference (the fp64 rung; NaN without an own twin), the first tap that differs."""
    rows: dict = {}
    for t in c.get("taps", []):
        key = (t.get("layer"), t.get("component"))
        r = rows.setdefault(key, {"layer": key[0], "component": key[1], "kind": "exact", "taps": 0, "equal": 0,
                                  "max_ulp": 0.0, "rel_l2": 0.0, "ratio": 0.0, "twin": 0.0, "first": None})
        r["taps"] += 1
        r["equal"] += bool(t.get("bitwise_equal"))
        if _kind_index(t.get("kind")) > _kind_index(r["kind"]):
            r["kind"] = t.get("kind")
        for k, v in (("max_ulp", number(t.get("max_ulp"))), ("rel_l2", number(t.get("rel_l2"))),
                     ("ratio", _ratio(t)), ("twin", number(t.get("twin_rel")))):
            r[k] = v if math.isnan(v) or math.isnan(r[k]) else max(r[k], v)
        if r["first"] is None and not t.get("bitwise_equal"):
            r["first"] = t.get("name")
    return list(rows.values())


def side_differences(d: dict) -> list[tuple]:
    """The device circumstance's two records (d["sides"]: each side's compare.environment record,
    its model's plan included), where they differ, in the records' order: (key, A's value, B's),
    "-" where a side lacks the key; [] for a result without sides."""
    sides = d.get("sides") or {}
    if not sides:
        return []
    ea, eb = sides["A"]["environment"], sides["B"]["environment"]
    return [(k, ea.get(k, "-"), eb.get(k, "-")) for k in dict.fromkeys([*ea, *eb]) if ea.get(k) != eb.get(k)]


def sides_lines(d: dict) -> list[str]:
    """The two sides for the terminal: their labels, then the lines of their records that differ
    (the caps in force, the libraries' code paths, the plan's choices); [] without sides."""
    sides = d.get("sides") or {}
    if not sides:
        return []
    lines = ["", "the two sides:", f"  A: {sides['A']['label']}", f"  B: {sides['B']['label']}",
             "  where their records differ (A | B):"]
    return lines + ([f"    {k}: {a} | {b}" for k, a, b in side_differences(d)] or ["    nowhere"])


def format_table(result, colour: bool = False) -> str:
    """The worst comparison per layer and component, then one line per comparison."""
    d = _as_dict(result)
    c = worst(d)

    def kind(k):
        return f"\033[{KIND_ANSI.get(k, '0')}m{k:<9}\033[0m" if colour else f"{k:<9}"
    lines = [f"probe where [{d['model']}], {d['circumstance']}: {d['verdict']}", f"  {d.get('hint', '')}", "",
             f"per layer and component, worst comparison: {c['name']}"]
    hdr = (f"{'layer':>5} {'component':<11} {'verdict':<9} {'bitwise':>7} {'max ulp':>9} {'rel diff':>9} "
           f"{'vs bound':>8} {'twin diff':>9}  first differing tap")
    lines += [hdr, "-" * len(hdr)]
    for r in component_rows(c):
        layer = "" if r["layer"] is None else r["layer"]
        lines.append(f"{layer!s:>5} {r['component']:<11} {kind(r['kind'])} {r['equal']:>3}/{r['taps']:<3} "
                     f"{_f(r['max_ulp'], '.0f'):>9} {_f(r['rel_l2']):>9} {_f(r['ratio'], '.2f'):>8} "
                     f"{_f(r['twin']):>9}  {r['first'] or ''}")
    lines += ["", f"{'comparison':<48} {'verdict':<9} {'first difference':<22} first beyond drift"]
    for x in d["comparisons"]:
        fd, fb = x.get("first_difference"), x.get("first_beyond")
        lines.append(f"{x['name'][:48]:<48} {kind(x['verdict'])} {(fd or {}).get('tap', '-'):<22} "
                     f"{(fb or {}).get('tap', '-')}")
    lines.append(f"cost: {d.get('cost')}; seconds: {d.get('seconds', {}).get('total')}")
    return "\n".join(lines + sides_lines(d))


def to_document(result, meta: dict | None = None) -> dict:
    return {"meta": dict(meta or {}), "result": _as_dict(result)}


def write_json(result, path, meta: dict | None = None) -> Path:
    text = json_text(to_document(result, meta), indent=1, default=str)
    return atomic_write(Path(path), text, "probe where JSON")


def _clip(v: float) -> float:
    return LOG_CLIP if not v > 0 else v


def _plot_envelope(c: dict) -> tuple[str | None, str]:
    """The worst comparison: B vs A per tap, B's and A's error vs the twin, the drift bound."""
    taps = c.get("taps", [])
    if not taps:
        return None, "no taps"
    plt = pyplot()
    x = list(range(len(taps)))
    fig, ax = plt.subplots(figsize=(11, 4))
    bound = [_clip(number(t.get("bound"))) for t in taps]
    ax.fill_between(x, LOG_CLIP, bound, color="#2e9d3a", alpha=0.12, label="drift envelope (m err_a + floor)")
    ax.plot(x, [_clip(number(t.get("err_a"))) for t in taps], color="#555", lw=1, label="A vs twin (err_a)")
    ax.plot(x, [_clip(number(t.get("err_b"))) for t in taps], color="#1f5fbf", lw=1, label="B vs twin (err_b)")
    ax.scatter(x, [_clip(number(t.get("rel_l2"))) for t in taps], s=10, zorder=3,
               c=[kind_hex(t.get("kind")) for t in taps], label="B vs A (colour: verdict)")
    twin = [number(t.get("twin_rel")) for t in taps]
    if any(not math.isnan(v) for v in twin):
        ax.plot(x, [_clip(v) for v in twin], color="#d0312d", lw=0.8, ls=":", label="twin in B vs twin in A")
    ax.set_yscale("log")
    ax.set_xlabel("tap (execution order)")
    ax.set_ylabel("relative L2")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return png(fig), (f"{c['name']}: per tap, the difference B vs A (dots) and each side's error against the "
                      "model's float64 twin; a tap is drift while err_b stays inside the shaded envelope and the "
                      "twin's two runs agree to the fp64 floor")


def _plot_all(d: dict) -> tuple[str | None, str]:
    comps = sorted(d["comparisons"], key=lambda c: -_kind_index(c.get("verdict")))[:MAX_LINES]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 3.6))
    for c in comps:
        vals = [_clip(number(t.get("rel_l2"))) for t in c.get("taps", [])]
        ax.plot(range(len(vals)), vals, lw=1, label=f"{c['name'][:40]} ({c.get('verdict')})")
    ax.set_yscale("log")
    ax.set_xlabel("tap (execution order)")
    ax.set_ylabel("B vs A, relative L2")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    return png(fig), f"B vs A against depth, {len(comps)} comparison(s) (zeros drawn at {LOG_CLIP:g})"


def _rows_html(c: dict) -> str:
    out = ["<table><tr><th>layer</th><th>component</th><th>verdict</th><th>bitwise</th><th>max ulp</th>"
           "<th>rel diff</th><th>err_b / bound</th><th>twin in B vs A</th><th>first differing tap</th></tr>"]
    for r in component_rows(c):
        out.append(f"<tr><td class='n'>{escape(r['layer'])}</td><td>{escape(r['component'])}</td>"
                   f"<td class='k' style='background:{kind_hex(r['kind'])}'>{escape(r['kind'])}</td>"
                   f"<td class='n'>{r['equal']}/{r['taps']}</td><td class='n'>{_f(r['max_ulp'], '.0f')}</td>"
                   f"<td class='n'>{_f(r['rel_l2'])}</td><td class='n'>{_f(r['ratio'], '.2f')}</td>"
                   f"<td class='n'>{_f(r['twin'])}</td>"
                   f"<td class='t'>{escape(r['first'] or '')}</td></tr>")
    return "".join(out) + "</table>"


def _sides_html(d: dict) -> str:
    """The device circumstance's two sides: their labels and where their records differ."""
    sides = d.get("sides") or {}
    if not sides:
        return ""
    a, b = escape(sides["A"]["label"]), escape(sides["B"]["label"])
    rows = "".join(f"<tr><th>{escape(k)}</th><td><code>{escape(x)}</code></td><td><code>{escape(y)}</code></td></tr>"
                   for k, x, y in side_differences(d)) or "<tr><td colspan='3'>nowhere</td></tr>"
    return (f"<h2>The two sides</h2><p>A: {a}<br>B: {b}</p><p class='cap'>where their records differ (each side's "
            f"environment, with its model's plan)</p><table><tr><th>record</th><th>A</th><th>B</th></tr>{rows}</table>")


def render_html(doc: dict) -> str:
    d, meta = doc["result"], doc.get("meta", {})
    c = worst(d)
    verdict = d.get("verdict")
    where, env = environment_section(meta)
    paras = "".join(f"<p>{escape(p)}</p>" for p in str(d.get("explanation", "")).split("\n")[1:])
    return "".join([
        head(f"probe where: {d['model']}, {d['circumstance']}"),
        f"<div class='head'><span class='badge' style='background:{kind_hex(verdict)}'>{escape(verdict)}</span>"
        f"<div><h1>probe where: {escape(d['model'])}</h1><div class='sub'>{escape(d['circumstance'])}, "
        f"{len(d['comparisons'])} comparison(s), target of {escape(d.get('target_length'))} tokens</div></div></div>",
        f"<div class='div' style='border-color:{kind_hex(verdict)}'>{escape(d.get('hint'))}</div>",
        "<h2>Difference against depth</h2>", figure("envelope", _plot_envelope, c), figure("all", _plot_all, d),
        f"<h2>Per layer and component: {escape(c['name'])}</h2>", _rows_html(c),
        _sides_html(d),
        "<h2>Every comparison</h2>", paras,
        "<h2>Drift bound</h2>", kv_table({"m (drift factor)": d.get("drift_factor"), "floor": d.get("floor"),
                                          "fp64 floor (twin rung)": d.get("twin_floor"),
                                          "streamed": d.get("streamed"), "cost": d.get("cost"),
                                          "seconds": d.get("seconds")}),
        "<h2>Run</h2>", kv_table({k: v for k, v in meta.items() if k != "environment"}),
        f"<h2>Environment</h2><p class='cap'>{escape(where)}</p>", kv_table(env), "</body></html>"])


def write_html(result, path, meta: dict | None = None) -> Path:
    return atomic_write(Path(path), render_html(to_document(result, meta)), "probe where HTML")
