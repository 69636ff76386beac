"""Reports for invariance probe results: a terminal table, JSON, a self-contained HTML page.

    print(format_table(results))
    write_json(results, "probes.json", meta={...})
    write_html(results, "probes.html", meta={...})

`results` is a list of ProbeResult (or their to_dict()). The page reuses the comparison
report's look (report/page.py: CSS, verdict colours, embedded matplotlib PNGs) and adds
three plots: bitwise-equal fraction vs batch size, distinct greedy completions per mode,
and the step at which a completion diverged against the top-1/top-2 margin there.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path

from llamaspec.files import atomic_write, json_text

from ..vocabulary import KIND_ANSI, KINDS, kind_hex
from .page import environment_section, escape, figure, head, kv_table, number, png, pyplot

MODE_STYLE = {"default": ("-", "o"), "invariant": ("--", "s")}


def _as_dict(r) -> dict:
    return r if isinstance(r, dict) else r.to_dict()


def worst_verdict(results) -> str:
    kinds = [_as_dict(r).get("verdict", "exact") for r in results]
    return max(kinds, key=lambda k: KINDS.index(k) if k in KINDS else -1, default="exact")


def _extra(d: dict) -> str:
    det = d.get("details") or {}
    if d.get("probe") == "divergence":
        return f"{det.get('distinct_completions')} distinct / {det.get('completions')}"
    if d.get("probe") == "cross_greedy":
        return f"{det.get('same_completions')}/{det.get('prompts')} same"
    if d.get("probe") == "determinism" and det.get("fresh_skipped"):
        return "no fresh runs"
    return ""


def _f(x, spec=".1e") -> str:
    v = number(x)
    return "nan" if math.isnan(v) else format(v, spec)


def format_table(results, colour: bool = False, hints: bool = True) -> str:
    """One row per probe result; the hint on the next line."""
    rows = [_as_dict(r) for r in results]
    head = (f"{'probe':<12} {'model':<34} {'verdict':<9} {'bitwise':>7} {'max ulp':>9} "
            f"{'max abs':>8} {'own err':>8} {'':<16}")
    lines = [head, "-" * len(head)]
    for d in rows:
        kind = str(d.get("verdict"))
        shown = f"\033[{KIND_ANSI.get(kind, '0')}m{kind:<9}\033[0m" if colour else f"{kind:<9}"
        lines.append(f"{d.get('probe', ''):<12} {str(d.get('model', ''))[:34]:<34} {shown} "
                     f"{number(d.get('bitwise_equal_frac')):>7.0%} {_f(d.get('max_ulp'), '.3g'):>9} "
                     f"{_f(d.get('max_abs')):>8} {_f(d.get('rounding_error')):>8} {_extra(d):<16}")
        if hints:
            lines.append(f"{'':<12} {d.get('hint', '')}")
    return "\n".join(lines)


def to_document(results, meta: dict | None = None) -> dict:
    rows = [_as_dict(r) for r in results]
    return {"verdict": worst_verdict(rows), "meta": dict(meta or {}), "results": rows}


def write_json(results, path, meta: dict | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, json_text(to_document(results, meta), indent=1), "JSON report")


# ---------------------------------------------------------------- plots

def _label(d: dict) -> str:
    return f"{d.get('impl')} {d.get('policy')}"


def _series_colours(labels):
    palette = ["#1f5fbf", "#d0312d", "#2e9d3a", "#e07b00", "#7a3fbf", "#00a0a0", "#8a5a00", "#555555"]
    return {label: palette[i % len(palette)] for i, label in enumerate(sorted(set(labels)))}


def _plot_bitwise_vs_batch(rows) -> tuple[str | None, str]:
    pts = defaultdict(lambda: defaultdict(list))      # (policy, impl, mode, group) -> B -> [equal]
    for d in rows:
        if d.get("probe") != "batch":
            continue
        for c in d.get("cases") or []:
            if c.get("batch_size"):
                pts[(d.get("policy"), d.get("impl"), d.get("mode"), c.get("group"))][
                    int(c["batch_size"])].append(bool(c.get("bitwise_equal")))
    if not pts:
        return None, "no batch probe in these results"
    plt = pyplot()
    policies = sorted({k[0] for k in pts})
    colours = _series_colours(k[1] for k in pts)
    fig, axes = plt.subplots(1, len(policies), figsize=(11, 3.8), squeeze=False, sharey=True)
    markers = {"equal": "o", "mixed": "^"}
    # series sitting on top of each other (all at 1.0, say) are offset a little to stay visible
    for ax, policy in zip(axes[0], policies):
        sizes = set()
        keys = [k for k in sorted(pts) if k[0] == policy]
        step = 0.06 / max(1, len(keys) - 1)
        offset = {k: step * (i - (len(keys) - 1) / 2) for i, k in enumerate(keys)}
        for key in keys:
            pol, impl, mode, group = key
            by_b = pts[key]
            bs = sorted(by_b)
            sizes.update(bs)
            ax.plot(bs, [sum(by_b[b]) / len(by_b[b]) + offset[key] for b in bs],
                    MODE_STYLE.get(mode, ("-", "o"))[0], marker=markers.get(group, "o"),
                    color=colours[impl], lw=1.4, ms=5, alpha=0.85,
                    label=f"{impl} {mode}, {group} lengths")
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(sizes))
        ax.set_xticklabels([str(b) for b in sorted(sizes)], fontsize=8)
        ax.minorticks_off()
        ax.set_ylim(-0.08, 1.08)
        ax.set_title(f"policy {policy}", fontsize=10)
        ax.set_xlabel("batch size")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("fraction bitwise equal to the target alone")
    handles = {}
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    axes[0][-1].legend(handles.values(), handles.keys(), fontsize=8, loc="upper left",
                       bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return png(fig), ("Per batch size: the fraction of target copies whose logits are bitwise "
                       "equal to the target run alone (random companions; the target at rows 0, "
                       "B/2 and B-1). Colour: implementation; solid: default mode, dashed: "
                       "batch-invariant mode; circles: companions of equal length, triangles: "
                       "mixed lengths (padded). Overlapping series are offset by up to "
                       "±0.03 so that each stays visible.")


def _plot_distinct(rows) -> tuple[str | None, str]:
    data = {}
    for d in rows:
        if d.get("probe") == "divergence":
            det = d.get("details") or {}
            data[(_label(d), d.get("mode"))] = (det.get("distinct_completions"), det.get("completions"))
    if not data:
        return None, "no divergence probe in these results"
    plt = pyplot()
    labels = sorted({k[0] for k in data})
    modes = [m for m in ("default", "invariant") if any(k[1] == m for k in data)]
    fig, ax = plt.subplots(figsize=(11, 3.6))
    w = 0.8 / max(1, len(modes))
    for j, mode in enumerate(modes):
        xs = [i + (j - (len(modes) - 1) / 2) * w for i in range(len(labels))]
        ys = [(data.get((label, mode)) or (0, 0))[0] or 0 for label in labels]
        bars = ax.bar(xs, ys, width=w, color="#1f5fbf" if mode == "default" else "#2e9d3a",
                      label=f"{mode} mode")
        for b, label in zip(bars, labels):
            n = (data.get((label, mode)) or (None, None))[1]
            if n:
                ax.annotate(f"{int(b.get_height())}/{n}", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=9)
    ax.set_ylabel("distinct greedy completions")
    from matplotlib.ticker import MaxNLocator  # matplotlib: slow import, only when a page is drawn
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return png(fig), ("Greedy completions of one prompt under different batchings (batch size, "
                       "row, padding): how many distinct ones each model produced. 1 means every "
                       "batching gave the same text.")


def _plot_margin(rows) -> tuple[str | None, str]:
    pts = defaultdict(list)
    thresholds = {}
    for d in rows:
        if d.get("probe") not in ("divergence", "cross_greedy"):
            continue
        key = f"{d.get('model')}" if d.get("probe") == "cross_greedy" else f"{_label(d)} {d.get('mode')}"
        thresholds[key] = 2 * number(d.get("threshold"))
        for c in d.get("cases") or []:
            if c.get("first_diff_step") is not None:
                pts[key].append((int(c["first_diff_step"]), max(number(c.get("margin")), 1e-9)))
    if not thresholds:
        return None, "no greedy probe in these results"
    if not pts:
        return None, "no greedy completion diverged from its reference: nothing to plot"
    plt = pyplot()
    colours = _series_colours(thresholds)
    fig, ax = plt.subplots(figsize=(11, 4.0))
    for key, p in sorted(pts.items()):
        ax.scatter([s for s, _ in p], [m for _, m in p], s=28, color=colours[key], alpha=0.75,
                   label=f"{key} ({len(p)} diverged)")
        t = thresholds.get(key)
        if t and math.isfinite(t) and t > 0:
            ax.axhline(t, color=colours[key], ls=":", lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("first step whose token differs from the reference completion")
    ax.set_ylabel("reference top-1 minus top-2 logit there")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    return png(fig), ("Each point is a completion that left the reference: where, and how close "
                       "the reference's top two tokens were there. Dotted lines: twice each "
                       "model's drift threshold, the most two runs' logits can move apart by "
                       "rounding; points below are near-tie flips (drift), points far above are not.")


# ---------------------------------------------------------------- page

def _summary_table(rows) -> str:
    head = ("<tr><th>probe</th><th>model</th><th>verdict</th><th>bitwise equal</th><th>max ULP</th>"
            "<th>max abs</th><th>own rounding error</th><th></th><th>hint</th></tr>")
    body = "".join(
        f"<tr><td>{escape(d.get('probe'))}</td><td>{escape(d.get('model'))}</td>"
        f"<td class='k' style='background:{kind_hex(d.get('verdict'))}'>{escape(d.get('verdict'))}</td>"
        f"<td class='n'>{number(d.get('bitwise_equal_frac')):.0%}</td>"
        f"<td class='n'>{escape(_f(d.get('max_ulp'), '.3g'))}</td><td class='n'>{escape(_f(d.get('max_abs')))}</td>"
        f"<td class='n'>{escape(_f(d.get('rounding_error')))}</td><td>{escape(_extra(d))}</td>"
        f"<td>{escape(d.get('hint'))}</td></tr>" for d in rows)
    return f"<table>{head}{body}</table>"


def _cases_table(d: dict) -> str:
    cases = d.get("cases") or []
    greedy = d.get("probe") in ("divergence", "cross_greedy")
    head = ("<tr><th>case</th><th>group</th><th>B</th><th>kind</th><th>bitwise</th><th>max abs</th>"
            "<th>rel L2</th><th>max ULP</th>" + ("<th>first diff step</th><th>margin</th>" if greedy else "")
            + "<th>note</th></tr>")
    rows = []
    for c in cases:
        step = '' if c.get('first_diff_step') is None else c['first_diff_step']
        margin = '' if c.get('margin') is None else _f(c['margin'], '.2e')
        g = f"<td class='n'>{escape(step)}</td><td class='n'>{escape(margin)}</td>" if greedy else ""
        rows.append(f"<tr><td>{escape(c.get('name'))}</td><td>{escape(c.get('group'))}</td>"
                    f"<td class='n'>{escape(c.get('batch_size'))}</td>"
                    f"<td class='k' style='background:{kind_hex(c.get('kind'))}'>{escape(c.get('kind'))}</td>"
                    f"<td>{'yes' if c.get('bitwise_equal') else 'no'}</td>"
                    f"<td class='n'>{escape(_f(c.get('max_abs')))}</td><td class='n'>{escape(_f(c.get('rel_l2')))}</td>"
                    f"<td class='n'>{escape(_f(c.get('max_ulp'), '.3g'))}</td>{g}<td>{escape(c.get('note'))}</td></tr>")
    return f"<table>{head}{''.join(rows)}</table>"


def render_html(doc: dict) -> str:
    """The page for to_document(results, meta) (or a JSON file's content)."""
    rows = list(doc.get("results") or [])
    meta = dict(doc.get("meta") or {})
    verdict = doc.get("verdict") or worst_verdict(rows)
    counts = {k: sum(d.get("verdict") == k for d in rows) for k in KINDS}
    title = f"Invariance probes: {verdict}"
    parts = [head(title)]
    parts.append(
        "<div class='head'>"
        f"<span class='badge' style='background:{kind_hex(verdict)}'>{escape(verdict)}</span>"
        f"<div><h1>Invariance probes</h1><div class='sub'>{len(rows)} probe results: "
        + ", ".join(f"<span style='color:{kind_hex(k)};font-weight:600'>{counts[k]} {k}</span>"
                    for k in KINDS if k != "precision")
        + (f"; checkpoint <code>{escape(meta.get('checkpoint'))}</code>" if meta.get("checkpoint") else "")
        + "</div></div></div>")
    parts.append("<p class='cap'>Each probe runs one target sequence in different circumstances "
                 "(batch companions, padding, repeats, other processes, greedy batchings) and "
                 "compares with the same model on the target alone. <b>exact</b>: bitwise equal; "
                 "<b>drift</b>: differences within 3x the model's own rounding error (its error "
                 "against itself computing in float64) plus a floor, i.e. another summation order; "
                 "<b>semantic</b>: beyond that, or NaN/Inf: a bug in masks, positions or caches.</p>")
    parts.append("<h2>Summary</h2>" + _summary_table(rows))
    for title, fn in (("Bitwise-equal fraction vs batch size", _plot_bitwise_vs_batch),
                      ("Distinct greedy completions per mode", _plot_distinct),
                      ("Divergence step vs margin", _plot_margin)):
        parts.append(f"<h2>{escape(title)}</h2>" + figure(title, fn, rows))
    parts.append("<h2>Every case</h2>")
    for d in rows:
        parts.append(f"<details><summary><span style='color:{kind_hex(d.get('verdict'))}'>"
                     f"{escape(d.get('verdict'))}</span> {escape(d.get('probe'))}: {escape(d.get('model'))} "
                     f"({len(d.get('cases') or [])} cases)</summary><p class='cap'>{escape(d.get('hint'))}</p>"
                     f"{_cases_table(d)}<p class='cap'>details: <code>{escape(json.dumps(d.get('details')))}"
                     "</code></p></details>")
    if meta:
        parts.append("<h2>Run</h2>" + kv_table({k: v for k, v in meta.items() if k != "environment"}))
    how, env = environment_section(meta)
    parts.append(f"<h2>Environment</h2><p class='cap'>{escape(how)}</p>{kv_table(env)}")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html(results, path, meta: dict | None = None) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, render_html(to_document(results, meta)), "HTML report")
