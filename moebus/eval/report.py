"""Plain-text tables and the JSON record of a run."""
from __future__ import annotations

from dataclasses import asdict

from moebus.eval.metrics import PerplexityStats
from moebus.eval.reference import Reference
from moebus.eval.run import Result, Settings


def table(rows: list[list[str]]) -> str:
    """rows[0] is the header; the first column left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                      for i, (c, w) in enumerate(zip(r, widths, strict=True))).rstrip()
                     for r in rows)


def ppl_diff_pct(stats: PerplexityStats, ref: Reference) -> float:
    return 100.0 * (stats.ppl / ref.stats.ppl - 1.0)


def _ppl_row(name: str, stats: PerplexityStats, ref: Reference) -> list[str]:
    return [name, f"{stats.nll:.4f}", f"{stats.ppl:.4f}", f"{ppl_diff_pct(stats, ref):+.3f}%",
            f"{stats.kl:.2e}", f"{stats.same_top_pct:.2f}%"]


def config_table(r: Result, ref: Reference, s: Settings) -> str:
    c = ref.chunks
    g = r.greedy
    inputs = " of synthetic token ids" if s.synthetic else ""
    lines = [f"== {r.name}: {r.description}; greedy {r.mode} ({r.seconds:.1f} s) ==",
             f"perplexity: {len(c)} chunks x {len(c[0].targets)} scored tokens{inputs} (ctx {s.ctx}, the first "
             f"half context), scored through {r.scored_by}",
             table([["", "NLL", "PPL", "vs HF fp32", "KL(ref||x)", "same top"],
                    ["HF fp32", f"{ref.stats.nll:.4f}", f"{ref.stats.ppl:.4f}", "-", "-", "-"],
                    _ppl_row(r.name, r.ppl, ref)]),
             f"greedy: {g.prompts} prompts{inputs} x {ref.max_tokens} tokens against HF fp32; "
             f"tie: HF fp32's logit margin < {g.tie_margin}",
             f"  matched {g.matched} / ties {len(g.ties)} / divergences {len(g.real)}"]
    if g.divergences:
        lines.append(table([["first divergence", "prompt (from 0)", "token", "margin"]] +
                           [["tie" if g.is_tie(d) else "DIVERGED", f"#{d.prompt}", str(d.position),
                             f"{d.margin:.4f}"] for d in g.divergences]))
    if r.counters:
        lines.append("  " + ", ".join(f"{k} {v}" for k, v in r.counters.items()))
    return "\n".join(lines)


def summary_table(results: list[Result], ref: Reference) -> str:
    rows = [["config", "greedy", "PPL", "vs HF fp32", "KL(ref||x)", "same top", "matched", "ties", "diverged"],
            ["hf-fp32 (ref)", "-", f"{ref.stats.ppl:.4f}", "-", "-", "-",
             f"{len(ref.prompts)}/{len(ref.prompts)}", "0", "0"]]
    for r in results:
        g = r.greedy
        rows.append([r.name, r.mode, *_ppl_row(r.name, r.ppl, ref)[2:],
                     f"{g.matched}/{g.prompts}", str(len(g.ties)), str(len(g.real))])
    return "== summary against HF transformers fp32 ==\n" + table(rows)


def to_json(results: list[Result], ref: Reference, s: Settings) -> dict:
    return {
        "settings": {k: str(v) if k in ("text", "prompts") else v for k, v in asdict(s).items()},
        "reference": {"name": "hf-fp32", "nll": ref.stats.nll, "ppl": ref.stats.ppl,
                      "chunks": len(ref.chunks), "scored_tokens": ref.stats.tokens, "prompts": len(ref.prompts)},
        "configs": [{
            "name": r.name, "description": r.description, "mode": r.mode, "seconds": r.seconds,
            "nll": r.ppl.nll, "ppl": r.ppl.ppl, "ppl_diff_pct": ppl_diff_pct(r.ppl, ref), "kl": r.ppl.kl,
            "same_top_pct": r.ppl.same_top_pct, "scored_tokens": r.ppl.tokens, "scored_by": r.scored_by,
            "counters": r.counters, "tokens": r.tokens,
            "greedy": {"prompts": r.greedy.prompts, "matched": r.greedy.matched, "ties": len(r.greedy.ties),
                       "diverged": len(r.greedy.real), "tie_margin": r.greedy.tie_margin,
                       "divergences": [{**asdict(d), "tie": r.greedy.is_tie(d)}
                                       for d in r.greedy.divergences]},
        } for r in results],
    }
