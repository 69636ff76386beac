"""The sweep's HTML page (compare.sweep.SweepResult): the table, KLD per policy, local error
against depth per policy, and each policy's sensitivity bars with the layers kept wide marked,
on the page toolkit (report/page.py).

Everything here renders the result's dict (SweepResult.to_dict(), or its JSON read back), so a
saved sweep renders again: `write_html(json.loads(Path("sweep.json").read_text()), "sweep.html")`.
"""

from __future__ import annotations

import math
from pathlib import Path

from llamaspec.files import atomic_write

from .page import environment_section, escape, figure, head, kv_table, number, png, pyplot

LOG_CLIP = 1e-18          # zeros are drawn here on the log axes
ORACLE = "fp64"
SUGGESTED = "#d0312d"     # the suggested mixed policies' colour
SWEPT = "#1f5fbf"


def _as_dict(r) -> dict:
    return r if isinstance(r, dict) else r.to_dict()


def _f(x, spec=".2e") -> str:
    v = number(x)
    return "nan" if math.isnan(v) else format(v, spec)


def _clip(v) -> float:
    v = number(v)
    return LOG_CLIP if not v > 0 else v


def _suggested(d: dict) -> dict:
    """{suggested policy name: its Suggestion dict}."""
    return {s["name"]: s for s in d.get("suggested") or []}


def _kept(d: dict) -> dict:
    """{policy name: the layers its suggestion keeps wide}."""
    return {s["policy"]: list(s["kept"]) for s in d.get("suggested") or []}


def _est(m: dict, key: str, scale: float = 1.0, spec=".3e") -> str:
    e = m.get(key) or {}
    return f"{_f(scale * number(e.get('value')), spec)} ± {_f(scale * number(e.get('se')), '.1e')}"


def _rows_html(d: dict) -> str:
    sugg = _suggested(d)
    out = ["<table><tr><th>candidate</th><th>base</th><th>mean KLD</th><th>KLD p99</th><th>KLD p99.9</th>"
           "<th>KLD max</th><th>same top p %</th><th>PPL ratio</th><th>RMS Δp %</th><th>tokens</th></tr>"]
    for r in d.get("rows") or []:
        m = r.get("measures") or {}
        pct = m.get("kld_percentiles") or {}
        style = f" style='color:{SUGGESTED}'" if r.get("candidate") in sugg else ""
        out.append(f"<tr><td class='t'{style}>{escape(r.get('candidate'))}</td><td class='t'>{escape(r.get('base'))}"
                   f"</td><td class='n'>{_est(m, 'kld_mean')}</td><td class='n'>{_f(pct.get('p99'))}</td>"
                   f"<td class='n'>{_f(pct.get('p99.9'))}</td><td class='n'>{_f(m.get('kld_max'))}</td>"
                   f"<td class='n'>{_est(m, 'same_top_p', 100, '.3f')}</td>"
                   f"<td class='n'>{_est(m, 'ppl_ratio', 1, '.5f')}</td><td class='n'>{_est(m, 'rms_dp', 100, '.3f')}"
                   f"</td><td class='n'>{escape(m.get('tokens'))}</td></tr>")
    return "".join(out) + "</table>"


def _layers_html(d: dict, shown: int = 5) -> str:
    sugg = {s["policy"]: s for s in d.get("suggested") or []}
    out = ["<table><tr><th>policy</th><th>most sensitive layers (local error, relative to the layer's output)</th>"
           "<th>each window's own top</th><th>row keeping layers wide</th></tr>"]
    for e in d.get("layers") or []:
        stream = e.get("stream") or []
        top = ", ".join(f"{i} ({_f(stream[i], '.1e')})" for i in (e.get("ranking") or [])[:shown] if i < len(stream))
        windows = "; ".join(", ".join(map(str, w)) for w in e.get("window_top") or [])
        s = sugg.get(e.get("policy"))
        out.append(f"<tr><td class='t'>{escape(e.get('policy'))}</td><td class='t'>{escape(top)}</td>"
                   f"<td class='t'>{escape(windows)}</td><td class='t'>{escape(s['name'] if s else '')}</td></tr>")
    return "".join(out) + "</table>"


def _greedy_html(d: dict) -> str:
    if not d.get("greedy"):
        return "<p>(not measured)</p>"
    out = ["<table><tr><th>policy</th><th>first generated token parting from fp64, per prompt</th>"
           "<th>parted</th></tr>"]
    for g in d["greedy"]:
        idx = g.get("indices") or []
        shown = ", ".join("-" if i is None else str(i) for i in idx)
        parted = sum(i is not None for i in idx)
        out.append(f"<tr><td class='t'>{escape(g.get('policy'))}</td><td class='t'>{escape(shown)}</td>"
                   f"<td class='n'>{parted}/{len(idx)} within {escape(g.get('new_tokens'))}</td></tr>")
    return "".join(out) + "</table>"


def _plot_kld(d: dict) -> tuple[str | None, str]:
    """Per policy against the oracle: mean KLD with its SE, p99 and max, on a log axis."""
    rows = [r for r in d.get("rows") or [] if r.get("base") == ORACLE]
    if not rows:
        return None, "no policy measured against the oracle"
    sugg = _suggested(d)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 0.45 * len(rows) + 1.2))
    y = list(range(len(rows)))[::-1]
    for yi, r in zip(y, rows):
        m = r.get("measures") or {}
        mean, se = number((m.get("kld_mean") or {}).get("value")), number((m.get("kld_mean") or {}).get("se"))
        colour = SUGGESTED if r.get("candidate") in sugg else SWEPT
        lo = max(mean - se, LOG_CLIP) if se == se else _clip(mean)
        ax.plot([lo, _clip(mean + se)], [yi, yi], color=colour, lw=3, alpha=0.5)
        ax.plot([_clip(mean)], [yi], "o", color=colour)
        ax.plot([_clip((m.get("kld_percentiles") or {}).get("p99"))], [yi], "|", color=colour, ms=14, mew=2)
        ax.plot([_clip(m.get("kld_max"))], [yi], "x", color=colour, ms=7)
    ax.set_yticks(y)
    ax.set_yticklabels([r.get("candidate", "?") for r in rows], fontsize=8)
    ax.set_xscale("log")
    ax.set_xlabel("KLD against fp64 (nats per token)")
    ax.grid(axis="x", alpha=0.3)
    for marker, label in (("o", "mean (bar: ± SE)"), ("|", "p99"), ("x", "max")):
        ax.plot([], [], marker, color="#555", label=label, ls="")
    ax.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 1.0), ncol=3, frameon=False)
    return png(fig), (f"KLD per policy against fp64 over {d.get('tokens')} tokens: mean with its standard error, "
                      f"p99 and max; red: a suggested mixed policy (zeros drawn at {LOG_CLIP:g})")


def _plot_depth(d: dict) -> tuple[str | None, str]:
    """Local error against depth, one line per policy (suggested ones dashed)."""
    layers = d.get("layers") or []
    if not layers:
        return None, "local errors per layer not measured (sensitivity windows 0)"
    sugg = _suggested(d)
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(10, 4))
    colours = {}      # a suggested policy drawn in its base's colour
    for e in layers:
        vals = [_clip(v) for v in e.get("stream") or []]
        dashed = e.get("policy") in sugg
        colour = colours.get(sugg[e["policy"]].get("policy")) if dashed else None
        line, = ax.plot(range(len(vals)), vals, lw=1.2, ls="--" if dashed else "-", marker=".", color=colour,
                        label=str(e.get("policy"))[:60])
        colours.setdefault(e.get("policy"), line.get_color())
        if dashed:
            kept = sugg[e["policy"]].get("kept") or []
            ax.plot(kept, [vals[i] for i in kept if i < len(vals)], "o", mfc="none", ms=9, color=line.get_color())
    ax.set_yscale("log")
    ax.set_xlabel("layer")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylabel("local error (||Δ update|| / ||output||)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return png(fig), ("Each layer's own error, teacher forced (every layer fed the oracle's input), over "
                      f"{d.get('sensitivity_windows')} window(s): the error of its update relative to its output; "
                      "dashed: a suggested policy, circles: its layers kept wide")


def _plot_bars(d: dict) -> tuple[str | None, str]:
    """Per swept policy its layers' local errors, the ones its suggestion keeps wide highlighted."""
    sugg = _suggested(d)
    layers = [e for e in d.get("layers") or [] if e.get("policy") not in sugg]
    if not layers:
        return None, "local errors per layer not measured (sensitivity windows 0)"
    kept = _kept(d)
    plt = pyplot()
    fig, axes = plt.subplots(len(layers), 1, figsize=(10, 1.5 * len(layers) + 0.6), squeeze=False, sharex=True)
    for ax, e in zip(axes[:, 0], layers):
        vals = [number(v) for v in e.get("stream") or []]
        keep = set(kept.get(e.get("policy"), []))
        bad = [i for i, v in enumerate(vals) if math.isnan(v)]
        top = max([v for v in vals if not math.isnan(v)] or [1.0]) or 1.0
        ax.bar(range(len(vals)), [top if math.isnan(v) else v for v in vals], hatch=None,
               color=["#000" if i in bad else SUGGESTED if i in keep else "#8aa6d6" for i in range(len(vals))])
        ax.set_title(str(e.get("policy"))[:80] + (f" (black: NaN at layer {', '.join(map(str, bad))})" if bad
                                                   else ""), fontsize=8, loc="right")
        ax.ticklabel_format(axis="y", style="sci", scilimits=(0, 0))
        ax.tick_params(labelsize=7)
        ax.grid(axis="y", alpha=0.3)
    axes[-1, 0].set_xlabel("layer")
    axes[-1, 0].xaxis.get_major_locator().set_params(integer=True)
    fig.tight_layout()
    return png(fig), ("Sensitivity per policy: each layer's local error (as above, linear axis); red: the layers "
                      f"its suggested policy keeps at {d.get('wide_policy')}")


def render_html(doc: dict) -> str:
    d = _as_dict(doc)
    title = f"sweep: {d.get('impl')} on {d.get('checkpoint')}"
    secs = d.get("seconds") or {}
    where, env = environment_section(d)
    sub = (f"{escape(d.get('tokens'))} tokens of {escape(d.get('text'))}, {escape(d.get('windows'))} window(s) of "
           f"{escape(d.get('window'))}; {_f(secs.get('total'), '.0f')} s")
    keep = (f"keeping the {escape(d.get('keep_wide'))} most sensitive layers of each policy at "
            f"<code>{escape(d.get('wide_policy'))}</code>" if d.get("keep_wide") else "no layers kept wide")
    return "\n".join([
        head(title), f"<h1>{escape(title)}</h1><div class='sub'>{sub}</div>",
        "<h2>What each policy costs</h2>", _rows_html(d),
        figure("KLD per policy", _plot_kld, d),
        f"<h2>Which layers each policy hurts</h2><p class='cap'>Local error per layer by teacher forcing over "
        f"{escape(d.get('sensitivity_windows'))} window(s); {keep}: its row above (red) is the mixed policy run over "
        "the same text (docs/sweep.md).</p>", _layers_html(d),
        figure("local error vs depth", _plot_depth, d), figure("sensitivity bars", _plot_bars, d),
        "<h2>Greedy divergence</h2>", _greedy_html(d),
        "<h2>Run</h2>", kv_table({"impl": d.get("impl"), "checkpoint": d.get("checkpoint"), "text": d.get("text"),
                                  "policies": ", ".join(d.get("policies") or []),
                                  "greedy prompt tokens": d.get("greedy_prompt_tokens"),
                                  **{k: _f(v, ".1f") for k, v in secs.items()}}),
        f"<h2>Environment</h2><p class='cap'>{escape(where)}</p>", kv_table(env), "</body></html>"])


def write_html(result, path) -> Path:
    """The page for a SweepResult (or its dict, or its JSON read back) written to `path` atomically."""
    return atomic_write(Path(path), render_html(_as_dict(result)), "sweep HTML")
