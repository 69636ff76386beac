"""A self-contained HTML page for one comparison Report.

`render_html(report_dict)` takes `Report.to_dict()` (non-finite floats arrive as the
strings "nan"/"inf") and returns one HTML document with no external resources: the
plots are matplotlib (Agg) PNGs embedded as base64 data URIs, every string is escaped.
`write_html(report, path)` accepts a Report or its dict.
"""

from __future__ import annotations

import math
from pathlib import Path

from llamaspec import Policy
from llamaspec.files import atomic_write

from ..results import NONE, NONE_AT_FP64, RETURNED, TAP
from ..vocabulary import KIND_HEX, TAP_KINDS, drift_factor, kind_hex, precision_floor
from .page import environment_section, escape, figure, head, kv_table, number, png, pyplot

LOG_CLIP = 1e-18            # zero errors are drawn at this value on the log axes
COLLAPSE_AFTER = 40         # tap tables longer than this fold the quiet rows away


def _fmt(x) -> str:
    v = number(x)
    return "nan" if math.isnan(v) else f"{v:.2e}"


def _envelope(policy: dict) -> tuple[float, float]:
    """The engine's drift bound for this policy: err(cand) <= m * err(ref) + floor."""
    for make in (lambda: Policy(**policy),   # a hand-made dict: its compute dtype, else fp32's
                 lambda: Policy.get("fp32", compute_dtype=policy["compute_dtype"]),
                 lambda: Policy.get("fp32")):
        try:
            p = make()
            return drift_factor(p), precision_floor(p)
        except Exception:  # noqa: BLE001 - a plot must never cost the page
            continue


# ---------------------------------------------------------------- plots


def _clip(vals):
    """Zeros/negatives -> LOG_CLIP (counted); NaN stays NaN (a gap in the line)."""
    out, clipped = [], 0
    for v in vals:
        v = number(v)
        if math.isinf(v):
            v = math.nan
        if not math.isnan(v) and v <= LOG_CLIP:
            v, clipped = LOG_CLIP, clipped + 1
        out.append(v)
    return out, clipped


def _depth_taps(taps: list[dict]) -> list[dict]:
    return [t for t in taps if str(t.get("tap", "")).endswith(".out") and t.get("layer") is not None
            or t.get("tap") in ("final_norm", "logits")]


def _plot_depth(taps: list[dict], policy: dict) -> tuple[str | None, str]:
    rows = _depth_taps(taps)
    if not rows:
        return None, "no layer output taps in this report"
    plt = pyplot()
    x = list(range(len(rows)))
    labels = [str(r["layer"]) if r.get("layer") is not None else
              ("norm" if r["tap"] == "final_norm" else str(r["tap"])) for r in rows]
    ref, c1 = _clip(r.get("err_ref") for r in rows)
    cand, c2 = _clip(r.get("err_cand") for r in rows)
    f64, c3 = _clip(r.get("err_fp64") for r in rows)
    m, floor = _envelope(policy)
    env = [math.nan if math.isnan(v) else m * v + floor for v in ref]

    fig, ax = plt.subplots(figsize=(11, 4.2))
    ax.fill_between(x, LOG_CLIP, env, color="#2e9d3a", alpha=0.08, linewidth=0)
    ax.plot(x, env, "-", lw=1.2, color="#2e9d3a",
            label=f"drift envelope: {m:g}·err_ref + {floor:.1e} (shaded below)")
    ax.plot(x, ref, "-", lw=4, alpha=0.45, color="#1f5fbf",
            label="err_ref: reference @ policy vs fp64 oracle")
    ax.plot(x, cand, "-o", lw=1.2, ms=3, color="#000000",
            label="err_cand: candidate @ policy vs oracle")
    ax.plot(x, f64, "--", lw=1.2, marker=".", ms=4, color="#7a3fbf",
            label="err_fp64: candidate @ fp64 vs oracle")
    for kind in ("precision", "semantic"):
        idx = [i for i, r in enumerate(rows) if r.get("kind") == kind]
        if idx:
            ax.scatter([x[i] for i in idx], [cand[i] for i in idx], s=90, zorder=5,
                       facecolors="none", edgecolors=kind_hex(kind), linewidths=2.2,
                       label=f"{kind} tap")
    _mark_inner_findings(ax, rows, taps)
    ax.set_yscale("log")
    ax.set_xticks(x)
    ax.set_xticklabels(labels, fontsize=8, rotation=0 if len(x) <= 40 else 90)
    for lbl in ax.get_xticklabels():
        if not lbl.get_text().isdigit():
            lbl.set_rotation(45)
            lbl.set_horizontalalignment("right")
    _label_axes(ax, "layer (output of each block), then final norm and logits", grid_axis="both")
    caption = _depth_caption(c1 + c2 + c3, sum(math.isnan(v) for v in ref + cand + f64))
    return png(fig), caption


def _mark_inner_findings(ax, rows, taps) -> None:
    """Findings at taps inside a block (q_rope, act, ...) have no point of their own on the
    depth axis: a vertical line at that block's output marks them."""
    pos = {r.get("layer"): i for i, r in enumerate(rows) if r.get("layer") is not None}
    marked, labelled = set(), set()
    for t in taps:
        kind, layer = t.get("kind"), t.get("layer")
        if (kind in ("precision", "semantic") and layer in pos
                and not str(t.get("tap")).endswith(".out") and (layer, kind) not in marked):
            marked.add((layer, kind))
            ax.axvline(pos[layer], color=kind_hex(kind), lw=1.5, ls=":", alpha=0.8,
                       label=None if kind in labelled else f"{kind} inside block")
            labelled.add(kind)


def _depth_caption(clipped: int, nans: int) -> str:
    caption = ("Error of each side against the fp64 oracle along depth. The shaded band is the "
               "drift envelope; the candidate is within drift while its line stays inside it. "
               "Circles mark block outputs "
               "with a precision/semantic finding; a dotted vertical line marks a finding at a "
               "tap inside that block (see the table).")
    if clipped:
        caption += f" {clipped} zero value(s) were clipped to {LOG_CLIP:.0e} to fit the log scale."
    if nans:
        caption += f" {nans} non-finite value(s) are left out (gaps in the lines)."
    return caption


def _label_axes(ax, xlabel: str, grid_axis: str) -> None:
    """Shared look of both plots: error axis label, light grid, legend outside the axes."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel("relative L2 error vs fp64 oracle")
    ax.grid(True, axis=grid_axis, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def _plot_local(taps: list[dict], local: list[dict]) -> tuple[str | None, str]:
    if not local:
        return None, ("No teacher-forced (local) errors in this report, so local and inherited "
                      "error cannot be separated.")
    plt = pyplot()
    full = {t.get("layer"): t for t in taps if str(t.get("tap", "")).endswith(".out")
            and t.get("layer") is not None}
    rows = sorted(local, key=lambda r: number(r.get("layer")))
    layers = [r.get("layer") for r in rows]
    series = [
        ("ref local (oracle input forced)", [r.get("ref_local") for r in rows], "#8fb3e8"),
        ("cand local (oracle input forced)", [r.get("cand_local") for r in rows], "#9a9a9a"),
        ("ref full run (local + inherited)", [full.get(i, {}).get("err_ref") for i in layers], "#1f5fbf"),
        ("cand full run (local + inherited)", [full.get(i, {}).get("err_cand") for i in layers], "#000000"),
    ]
    fig, ax = plt.subplots(figsize=(11, 3.8))
    w = 0.8 / len(series)
    clipped, shown = 0, []
    for k, (label, vals, colour) in enumerate(series):
        ys, c = _clip(vals)
        clipped += c
        shown += [v for v in ys if not math.isnan(v)]
        xs = [i + (k - (len(series) - 1) / 2) * w for i in range(len(layers))]
        ax.bar(xs, [0 if math.isnan(v) else v for v in ys], width=w, color=colour, label=label,
               bottom=0)
    ax.set_yscale("log")
    if shown:
        ax.set_ylim(min(shown) / 3, max(shown) * 3)
    ax.set_xticks(range(len(layers)))
    ax.set_xticklabels([str(i) for i in layers], fontsize=8)
    _label_axes(ax, "layer", grid_axis="y")
    caption = ("Per layer: the error a layer adds on its own when fed the oracle's input "
               "(local), against the error of its output in the full run (local + inherited "
               "from earlier layers). A full-run bar far above the local one means the error "
               "was inherited.")
    if clipped:
        caption += f" {clipped} zero value(s) were clipped to {LOG_CLIP:.0e} to fit the log scale."
    return png(fig), caption


def _local_table(local: list[dict]) -> str:
    cols = (("ref_local", "ref local"), ("cand_local", "cand local"),
            ("ref_amplification", "ref amplification"), ("cand_amplification", "cand amplification"))
    head = "".join(f"<th>{escape(label)}</th>" for _, label in cols)
    rows = "".join(f"<tr><td>{escape(row.get('layer'))}</td>"
                   + "".join(f"<td class='n'>{_fmt(row.get(k)) if row.get(k) is not None else ''}"
                             "</td>" for k, _ in cols) + "</tr>" for row in local)
    return ("<details><summary>Per layer: local error and amplification (full-run error of "
            "the layer's output / of its input)</summary>"
            f"<table><tr><th>layer</th>{head}</tr>{rows}</table></details>")


LOGIT_COLUMNS = (("rel_l2", "rel L2"), ("max_abs", "max abs"), ("kl_mean", "KL mean"),
                 ("kl_max", "KL max"), ("top1_agreement", "top-1 agree"),
                 ("top5_overlap", "top-5 overlap"), ("top1_disagree", "top-1 flips"),
                 ("disagree_ref_margin_max", "largest margin flipped"))


def _logits_table(pairs: dict) -> str:
    head = "".join(f"<th>{escape(label)}</th>" for _, label in LOGIT_COLUMNS)
    rows = []
    for name, m in pairs.items():
        cells = "".join(f"<td class='n'>{escape(m.get(k)) if k == 'top1_disagree' else _fmt(m.get(k))}"
                        "</td>" for k, _ in LOGIT_COLUMNS)
        rows.append(f"<tr><th>{escape(name)}</th>{cells}</tr>")
    return f"<table><tr><th>pair</th>{head}</tr>{''.join(rows)}</table>"


def _plot_logits(positions: dict) -> tuple[str | None, str]:
    kl = positions.get("kl_cand_ref") or []
    if not kl:
        return None, "no per-position logits in this report"
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(11, 3.4))
    x = list(range(len(kl)))
    ys, clipped = _clip(kl)
    ax.plot(x, ys, color="#000000", lw=1, label="KL(reference || candidate)")
    own, c2 = _clip(positions.get("kl_ref_oracle") or [])
    clipped += c2
    if own:
        ax.plot(x, own, color="#1f5fbf", lw=1, alpha=0.7, label="KL(oracle || reference)")
    flips = [i for i, ok in enumerate(positions.get("top1_agree") or []) if not ok]
    for i in flips:
        ax.axvline(i, color=KIND_HEX["precision"], lw=1, ls=":")
    ax.set_yscale("log")
    ax.set_xlabel("position (real tokens, row by row)")
    ax.set_ylabel("KL divergence (nats)")
    margin = positions.get("ref_margin") or []
    if margin:
        ax2 = ax.twinx()
        ax2.plot(x, [number(v) for v in margin], color="#9a9a9a", lw=0.8, alpha=0.8,
                 label="reference top-1 - top-2 logit margin")
        ax2.set_ylabel("logit margin")
        ax2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.07, 0.55), borderaxespad=0)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.07, 1.0), borderaxespad=0)
    caption = (f"Per position: how far the candidate's next-token distribution is from the "
               f"reference's (black) next to the reference's own distance from the fp64 oracle "
               f"(blue), and the reference's top-1/top-2 margin (grey). {len(flips)} position(s) "
               "where the top-1 token differs are marked with dotted lines; a flip where the "
               "margin is near zero is a near tie, one where it is large is not rounding.")
    if clipped:
        caption += f" {clipped} zero value(s) were clipped to {LOG_CLIP:.0e} to fit the log scale."
    return png(fig), caption


# ---------------------------------------------------------------- page


def _tap_row(t: dict) -> str:
    kind = t.get("kind", "")
    m = t.get("metrics") or {}
    layer = t.get("layer")
    return ("<tr>"
            f"<td class='t'>{escape(t.get('tap'))}</td>"
            f"<td>{escape('' if layer is None else layer)}</td>"
            f"<td>{escape(t.get('component'))}</td>"
            f"<td class='k' style='background:{kind_hex(kind)}'>{escape(kind)}</td>"
            f"<td class='n'>{escape(_fmt(t.get('err_ref')))}</td>"
            f"<td class='n'>{escape(_fmt(t.get('err_cand')))}</td>"
            f"<td class='n'>{escape(_fmt(t.get('err_fp64')))}</td>"
            + "".join(f"<td class='n'>{_metric(m.get(k), k)}</td>" for k in _METRIC_KEYS)
            + f"<td>{escape(t.get('hint'))}</td></tr>")


_METRIC_KEYS = ("max_abs", "max_ulp", "cosine", "frac_beyond")


def _metric(x, key) -> str:
    v = number(x)
    if math.isnan(v):
        return "" if x is None else "nan"
    if key == "max_ulp":
        return f"{v:.0f}" if v < 1e6 else f"{v:.1e}"
    if key == "cosine":
        return f"1 - {1 - v:.1e}" if 0.99 < v < 1 else f"{v:.6f}"
    return f"{v:.2e}"


_TAP_HEAD = ("<tr><th>tap</th><th>layer</th><th>component</th><th>kind</th><th>err_ref</th>"
             "<th>err_cand</th><th>err_fp64</th><th>max abs</th><th>max ULP</th><th>cosine</th>"
             "<th>beyond 16u</th><th>hint</th></tr>")


def _tap_table(taps: list[dict]) -> str:
    if not taps:
        return "<p>No taps in this report.</p>"
    if len(taps) <= COLLAPSE_AFTER:
        return f"<table>{_TAP_HEAD}{''.join(_tap_row(t) for t in taps)}</table>"
    loud = [t for t in taps if t.get("kind") in ("precision", "semantic")]
    conv = [t for t in taps if t.get("kind") == "convention"]
    quiet = [t for t in taps if t.get("kind") not in ("precision", "semantic", "convention")]
    out = []
    if loud:
        out.append(f"<p>{len(loud)} tap(s) with a precision or semantic finding:</p>"
                   f"<table>{_TAP_HEAD}{''.join(_tap_row(t) for t in loud)}</table>")
    if conv:
        out.append(f"<p>{len(conv)} tap(s) differ by a convention that changes no prediction (not findings):</p>"
                   f"<table>{_TAP_HEAD}{''.join(_tap_row(t) for t in conv)}</table>")
    out.append(f"<details><summary>{'All other' if loud or conv else 'All'} {len(quiet)} taps "
               f"(exact/drift/inherited), in execution order</summary>"
               f"<table>{_TAP_HEAD}{''.join(_tap_row(t) for t in quiet)}</table></details>")
    return "".join(out)


def _counts(taps: list[dict]) -> str:
    n = {k: sum(t.get("kind") == k for t in taps) for k in TAP_KINDS}
    return ", ".join(f"<span style='color:{kind_hex(k)};font-weight:600'>{n[k]} {k}</span>"
                     for k in TAP_KINDS if k not in ("inherited", "convention") or n[k])


def _divergence_block(r: dict, verdict: str) -> str:
    d = r.get("first_divergence")
    if d:
        return (f"<div class='div' style='border-color:{kind_hex(d.get('kind'))}'>"
                f"<b>First divergence:</b> <b style='color:{kind_hex(d.get('kind'))}'>{escape(d.get('kind'))}"
                f"</b> at tap <code>{escape(d.get('tap'))}</code> (layer {escape(d.get('layer'))}, component "
                f"{escape(d.get('component'))})<br>{escape(d.get('hint'))}"
                + (f"<br><i>{escape(d.get('evidence'))}</i>" if d.get("evidence") else "") + "</div>")
    if verdict in ("exact", "drift"):
        return (f"<div class='ok'><b>{escape(verdict)}:</b> no precision or semantic difference "
                "found. The candidate's error against the fp64 oracle stays within what the "
                "reference itself shows at this policy.</div>")
    return (f"<div class='div' style='border-color:{kind_hex(verdict)}'>Verdict "
            f"{escape(verdict)} but no first divergence was recorded.</div>")


def _notes(r: dict, pname: str) -> list[str]:
    """What the reader must know beside the verdict: configs that differ, rungs not run."""
    notes = []
    if isinstance(r.get("nonfinite"), dict) and r["nonfinite"].get("tap"):
        notes.append(str(r["nonfinite"].get("note") or f"NaN/Inf first at {r['nonfinite']['tap']}"))
    if r.get("config_differences"):
        notes.append("The configs differ: " + "; ".join(map(str, r["config_differences"])))
    if r.get("teacher_forcing", "run") not in ("run", "off"):      # "not run: <why>"
        notes.append(f"Teacher forcing {r['teacher_forcing']}")
    if r.get("semantic_rung", "run") != "run":
        notes.append(f"fp64 rung {r['semantic_rung']}: the candidate's taps are judged at {pname} by structure "
                     "alone; a lower-precision step and a small change in the math can look alike")
    twin = r.get("twin")                # a refused twin's note is in the fp64 rung's line above
    if isinstance(twin, dict) and twin.get("note") and twin.get("status") != "refused":
        notes.append(str(twin["note"]))
    cover = r.get("coverage")
    if isinstance(cover, dict) and cover.get("note"):
        notes.append(str(cover["note"]))
    if not notes:
        return []
    return ["<div class='div' style='border-color:#555555'>" + "<br>".join(escape(n) for n in notes) + "</div>"]


_CAPTURE_HEAD = ("<tr><th>side</th><th>logits dtype</th><th>taps captured</th><th>plain run</th><th>bitwise</th>"
                 "<th>rel L2</th><th>max ULP</th><th>max abs</th></tr>")


def _capture_rows(role: str, c: dict) -> str:
    runs = list(c.get("against") or []) + ([c["again"]] if c.get("again") else [])
    side = f"{escape(role)} <code>{escape(c.get('side'))}</code>"
    if not runs:
        return f"<tr><td>{side}</td><td colspan='7'>not run</td></tr>"
    rows = []
    for i, a in enumerate(runs):
        first = (side, escape(c.get("dtype")), escape(c.get("taps"))) if i == 0 else ("", "", "")
        rows.append(f"<tr><td>{first[0]}</td><td>{first[1]}</td><td class='n'>{first[2]}</td>"
                    f"<td>{escape(a.get('baseline'))}</td><td>{'yes' if a.get('bitwise') else '<b>no</b>'}</td>"
                    f"<td class='n'>{_fmt(a.get('rel_l2'))}</td><td class='n'>{_metric(a.get('max_ulp'), 'max_ulp')}"
                    f"</td><td class='n'>{_fmt(a.get('max_abs'))}</td></tr>")
    return "".join(rows)


def _capture_section(capture: dict) -> list[str]:
    """Per side at the policy: its capturing run's logits against its plain runs (Report.capture),
    each side's sentence, and a warning box where a capture is not its plain run's bytes."""
    if not capture:
        return []
    changed = [c for c in capture.values() if c.get("against") and c.get("bitwise") is False]
    box = ("<div class='div' style='border-color:#b00020'><b>Capture changes the numbers.</b><br>"
           + "<br>".join(escape(c.get("note")) for c in changed) + "</div>") if changed else ""
    notes = "".join(f"<li>{escape(role)}: {escape(c.get('note'))}</li>" for role, c in capture.items())
    return [box, "<h2>Capture check</h2><p class='cap'>Per side at the policy: the logits of the run that captured "
            "the taps against the same inputs run plainly (the logits alone, the plain forward, and the forward "
            "again: does the side repeat itself?), over real positions. Bitwise is expected; a difference is the "
            "floor of what that side's taps can show. The fp64 runs are not checked. The verdict judges the "
            "taps as captured.</p>",
            f"<table>{_CAPTURE_HEAD}{''.join(_capture_rows(role, c) for role, c in capture.items())}</table>",
            f"<ul>{notes}</ul>"]


def _coverage_section(cover) -> str:
    """Report.coverage: the reference's taps that were not judged (the candidate returns no such
    tap), by step, the lm_head first where it was not judged, and how each side's logits were
    judged where a side has no "logits" tap."""
    if not isinstance(cover, dict):
        return ""
    unjudged = dict(cover.get("unjudged") or {})
    logits = dict(cover.get("logits") or {})
    others = [str(t) for t in cover.get("candidate_only") or []]
    if not unjudged and not others and all(h == TAP for h in logits.values()):
        return ""
    order = (["logits"] if "logits" in unjudged else []) + [k for k in unjudged if k != "logits"]
    rows = "".join(f"<tr><td class='t'>{escape(step)}</td><td class='n'>{len(unjudged[step])}</td>"
                   f"<td>{escape(', '.join(map(str, unjudged[step])))}</td></tr>" for step in order)
    how = "".join(f"<li>{escape(role)} <code>{escape(cover.get(role))}</code>: logits judged from its "
                  f"{escape(_LOGITS_FROM.get(h, h))}</li>" for role, h in logits.items())
    table = (f"<table><tr><th>step</th><th>taps</th><th>not judged</th></tr>{rows}</table>" if rows else
             "<p>Every tap of the reference was judged.</p>")
    extra = (f"<p>The candidate's taps the reference has no oracle for (not judged): "
             f"{escape(', '.join(others))}</p>" if others else "")
    return ("<h2>Not judged</h2><p class='cap'>A tap is judged where both sides return it: the reference's taps "
            f"below were not looked at ({escape(cover.get('judged'))} of its {escape(cover.get('reference_taps'))} "
            "taps were judged). The lm_head is judged at the logits: where a side has no \"logits\" tap, the "
            "logits its capture returns stand in for it.</p>" + f"<ul>{how}</ul>" + table + extra)


# How each side's logits were judged (compare.results.Coverage.logits), for the page.
_LOGITS_FROM = {TAP: "'logits' tap", RETURNED: "capture's returned logits (it has no 'logits' tap)",
                NONE: "nothing: it returns no logits and has no 'logits' tap: the lm_head is not judged",
                NONE_AT_FP64: "nothing: its float64 run returns no logits: the lm_head is not judged"}


def render_html(report_dict: dict) -> str:
    r = report_dict
    taps = list(r.get("taps") or [])
    local = list(r.get("local") or [])
    policy = dict(r.get("policy") or {})
    verdict = str(r.get("verdict", "unknown"))
    pname = policy.get("name", "?")
    title = f"{r.get('candidate', '?')} vs {r.get('reference', '?')} at {pname}: {verdict}"

    parts = [head(title)]
    parts.append(
        "<div class='head'>"
        f"<span class='badge' style='background:{kind_hex(verdict)}'>{escape(verdict)}</span>"
        f"<div><h1>{escape(r.get('candidate', '?'))} vs {escape(r.get('reference', '?'))} at "
        f"{escape(pname)}</h1><div class='sub'>candidate <code>{escape(r.get('candidate'))}</code>, "
        f"reference <code>{escape(r.get('reference'))}</code>, policy <code>{escape(pname)}</code>; "
        f"{len(taps)} taps: {_counts(taps)}</div></div></div>")
    warning, *capture = _capture_section(dict(r.get("capture") or {})) or [""]
    parts += [warning, _divergence_block(r, verdict)] + _notes(r, pname) + capture
    parts.append("<h2>Error vs depth</h2>" + figure("error vs depth", _plot_depth, taps, policy))
    parts.append("<h2>Local vs inherited error per layer</h2>"
                 + figure("local vs inherited error", _plot_local, taps, local))
    if local:
        parts.append(_local_table(local))

    logits = r.get("logits") or {}
    if logits:
        parts.append("<h2>Logits agreement</h2><p class='cap'>Over real positions. KL is "
                     "KL(second || first) of each pair's next-token distributions; \"largest "
                     "margin flipped\" is the second's top-1/top-2 logit margin at the worst "
                     "position where the top-1 tokens differ (0 when none do).</p>")
        parts.append(_logits_table(logits.get("pairs") or {}))
        parts.append(figure("logits agreement per position", _plot_logits,
                             logits.get("positions") or {}))

    parts.append("<h2>Every tap</h2><p class='cap'>err_* are relative L2 errors against the "
                 "fp64 oracle (reference at fp64): err_ref = reference at the policy, err_cand = "
                 "candidate at the policy, err_fp64 = candidate at fp64. max abs, max ULP (in the "
                 "policy's compute dtype), cosine and \"beyond 16u\" (fraction of elements off by "
                 "more than 16 unit roundoffs of the element or of the tap's RMS) compare the "
                 "candidate with the reference at the policy.</p>")
    parts.append(_tap_table(taps))
    parts.append(_coverage_section(r.get("coverage")))

    parts.append("<h2>Policy</h2>")
    parts.append(kv_table(policy))
    how, env = environment_section(r)
    parts.append(f"<h2>Environment</h2><p class='cap'>{escape(how)}</p>")
    parts.append(kv_table(env))
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html(report, path) -> Path:
    """Writes the page for a Report (or its to_dict()) to `path`; returns the path."""
    d = report if isinstance(report, dict) else report.to_dict()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    return atomic_write(path, render_html(d), "HTML report")   # temp name + rename: never half a page
