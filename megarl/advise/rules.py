"""The decision rules of `megarl advise`: from the calibration's measurements to one strategy, with reasons.

One function per rule; :func:`recommend` applies them in order. Each rule is
tied to a measurement megarl made (docs/results.md, "Does exactness pay?") or
to Guan et al., arXiv 2605.12070 ("Missing Old Logits in Asynchronous
Agentic RL"):

1. :func:`exactness_can_change_update`: an exact anchor changes the update
   only through the tokens on which it differs from behav's anchor in the
   loss: those the train-inference rule masks or down-weights under the exact
   anchor, and those whose PPO clip decision differs between behav's anchor
   and the exact one. When both shares are below :data:`NEGLIGIBLE_SHARE`,
   exactness cannot change the update (megarl's CPU grids: r_d ~2e-3 nats,
   nothing masked, exact anchors level with behav in every grid).
2. :func:`cheapest_fitting_exact`: when exactness can change the update, the
   exact strategy with the smallest measured added step time among those that
   fit in memory. When the per-round difference of its added time to another
   fitting exact strategy has a 90% t interval over the interleaved repeats
   that holds 0, the measured cost does not decide and the cost-free order of
   :data:`EXACT` does: snapshot adds parameter copies, interrupt_sync also
   stops generation at every publish, dedicated also a scorer process and its
   device.
3. :func:`by_staleness`: when it cannot, choose by staleness and cost: with a
   mean token lag of at most :data:`STALE_LAG` optimizer steps behav (no
   cost; its anchor is the exact one within r_d); above it an anchor that
   follows the policy (megarl's grids at eta 8: ewma reached the reward
   threshold in 0.5-0.65x behav's steps on every grid and ended above behav
   on the MoE grid at 5 seeds): ewma when it fits in memory and its measured
   own time per step is at most :data:`EWMA_COST_SHARE` of its step, else
   linear (no forward; 0.57x behav's steps on the dense grid). With repeats,
   the share is the mean of the per-round shares; when its 90% t interval
   holds :data:`EWMA_COST_SHARE`, the measured cost does not decide and the
   cost-free rule does: ewma (when it fits). loglinear is never chosen: it
   ended below behav on the MoE grid at 5 seeds.
4. :func:`routing_replay`: for an MoE model, turn routing replay on when the
   trainer's own routers choose other experts than the engine's at the same
   version for more than :data:`FLIP_SHARE` of the tokens.
"""
from __future__ import annotations

from typing import Any

from megarl.bench.interleave import holds, t_interval

NEGLIGIBLE_SHARE = 0.01
"""Share of policy tokens below which a difference in the loss (masked, down-weighted, clipped differently) is
taken as no difference: 1%, well above what megarl's grids measured when exact anchors were level with behav
(0-0.1% down-weighted, nothing masked)."""
STALE_LAG = 1.0
"""Mean token lag (optimizer steps between a token's sampling version and the trainer's) above which the anchor's
staleness decides: the grids' eta 1 cells (lag <= 1) showed no gain from a policy-following anchor, eta 8 did."""
EWMA_COST_SHARE = 0.25
"""Largest measured critical-path time of ewma per step, as a share of its median step, for ewma to be chosen."""
FLIP_SHARE = 0.05
"""Share of tokens with any same-version route flip above which routing replay is turned on (the CPU MoE
measured 1.7-2.8% and replay changed no final reward; Guan et al. and R3 report ~10% on trained routers)."""

EXACT = ("snapshot", "interrupt_sync", "dedicated")


def _added(m: dict[str, Any], name: str) -> float | None:
    run = m["cost"]["runs"].get(name)
    return None if run is None else run.get("added_step_s")


def _fits(m: dict[str, Any], name: str) -> bool:
    return bool(m["memory"]["strategies"].get(name, {}).get("fits", False))


def exactness_can_change_update(m: dict[str, Any]) -> tuple[bool, str]:
    """Rule 1 (module doc): (whether it can, the reason with the measured shares)."""
    cal = m["calibration"]
    touched = cal["rule"]["masked_frac"] + cal["rule"]["downweighted_frac"]
    clip = cal["anchors"]["behav"]["clip_differs_frac"]
    gap = cal["gap"]
    said = (f"the train-inference gap is {gap['mean']:.2g} nats per token (p99 {gap['p99']:.2g}, max "
            f"{gap['max']:.2g}); under the exact anchor the configured rule masks or down-weights {touched:.2%} of "
            f"the policy tokens, and behav's anchor clips {clip:.2%} of them differently from the exact one")
    if touched > NEGLIGIBLE_SHARE or clip > NEGLIGIBLE_SHARE:
        return True, said + f": above {NEGLIGIBLE_SHARE:.0%}, so exactness can change the update"
    return False, said + f": both below {NEGLIGIBLE_SHARE:.0%}, so exactness cannot change the update"


def cheapest_fitting_exact(m: dict[str, Any]) -> tuple[str | None, str]:
    """Rule 2: the exact strategy with the smallest measured added step time that fits in memory (None: none)."""
    ok = [(_added(m, s), s) for s in EXACT if _added(m, s) is not None and _fits(m, s)]
    if not ok:
        unmeasured = [s for s in EXACT if _added(m, s) is None]
        return None, (f"no exact strategy was both measured and fits in memory (not measured: "
                      f"{', '.join(unmeasured) or 'none'})")
    cost, name = min(ok)
    tied = [(s, d) for c, s in ok if s != name and (d := _difference(m, s, name)) is not None and holds(d, 0.0)]
    if tied:
        pick = next(s for s in EXACT if s == name or s in dict(tied))
        gaps = "; ".join(f"{s} - {name}: {d['mean']:+.3f} s [{d['low']:+.3f}, {d['high']:+.3f}]" for s, d in tied)
        return pick, (f"{name} measured cheapest ({cost:.3f} s of its own per step), but its difference to "
                      f"{', '.join(s for s, _ in tied)} over the interleaved repeats holds 0 ({gaps}): the measured "
                      f"cost does not decide, so the cost-free order {', '.join(EXACT)}: {pick}")
    return name, (f"{name} is the cheapest exact strategy that fits in memory ({cost:.3f} s of its own per step, "
                  f"measured)")


def _difference(m: dict[str, Any], a: str, b: str) -> dict[str, Any] | None:
    """Per interleaved round, ``a``'s own seconds minus ``b``'s, and their t interval (None under 2 rounds)."""
    ra, rb = (m["cost"]["runs"][s].get("per_repeat") or [] for s in (a, b))
    if len(ra) != len(rb) or len(ra) < 2:
        return None
    return t_interval([x["added_step_s"] - y["added_step_s"] for x, y in zip(ra, rb)])


def by_staleness(m: dict[str, Any]) -> tuple[str, str]:
    """Rule 3: behav when tokens are fresh, else an anchor that follows the policy (ewma if cheap, else linear)."""
    lag = m["calibration"]["staleness"]["lag_mean"]
    if lag <= STALE_LAG:
        return "behav", (f"the mean token lag is {lag:.2f} optimizer steps (<= {STALE_LAG:g}): the anchor's "
                         f"staleness does not decide, and behav costs nothing")
    run = m["cost"]["runs"].get("ewma")
    said = f"the mean token lag is {lag:.2f} optimizer steps (> {STALE_LAG:g}): an anchor that follows the policy"
    if run is None:
        why = "ewma was not measured"
    elif not _fits(m, "ewma"):
        why = "ewma does not fit in memory"
    else:
        added, step = run["added_step_s"], run["step_time_s_median"]
        cost = f"ewma adds {added:.3f} s of its own to a {step:.3f} s step"
        share = run.get("share_interval")
        if holds(share, EWMA_COST_SHARE):
            return "ewma", said + (f"; {cost}, and its share of the step over {share['n']} interleaved repeats, "
                                   f"{_pct(share)}, holds {EWMA_COST_SHARE:.0%}: the measured cost does not decide, "
                                   f"so the cost-free rule: ewma, which fits in memory")
        cheap = share["share"] <= EWMA_COST_SHARE if share and share["low"] is not None else added <= \
            EWMA_COST_SHARE * step
        cost += f" ({_pct(share)} over {share['n']} repeats)" if share and share["low"] is not None else ""
        if cheap:
            return "ewma", said + f"; {cost} (<= {EWMA_COST_SHARE:.0%}) and fits in memory"
        why = f"{cost} (> {EWMA_COST_SHARE:.0%})"
    return "linear", said + f"; {why}, so linear (no forward)"


def _pct(share: dict[str, Any] | None) -> str:
    return "" if share is None or share["low"] is None else \
        f"{share['share']:.0%} [{share['low']:.0%}, {share['high']:.0%}]"


def routing_replay(m: dict[str, Any]) -> tuple[bool | None, str]:
    """Rule 4: (turn routing replay on?, reason); (None, reason) for a dense model or when flips were not counted."""
    cfg = m["config"]
    if not cfg["moe"]:
        return None, "dense model: routing replay does not apply"
    routes = m["calibration"].get("routes")
    if routes is None:
        return None, "no route flips were counted (the engines returned no routes)"
    share = routes["same_version"]["tokens_differ_frac"]
    said = (f"the trainer's routers choose other experts than the engine's at the same version for {share:.1%} of "
            f"the tokens; without replay r_d is {routes['r_d_abs_mean_no_replay']:.2g} nats per token")
    if share > FLIP_SHARE:
        return True, said + f" (> {FLIP_SHARE:.0%}): turn rollout.routing_replay on"
    return False, said + f" (<= {FLIP_SHARE:.0%}): replay changes little; keep it off unless it is free"


def recommend(m: dict[str, Any]) -> dict[str, Any]:
    """Apply the rules in order: ``{"strategy", "reasons", "routing_replay", "exactness_matters"}``."""
    matters, why = exactness_can_change_update(m)
    reasons = [why]
    if matters:
        name, said = cheapest_fitting_exact(m)
        reasons.append(said)
        if name is None:
            name, said = by_staleness(m)
            reasons.append("falling back to staleness: " + said)
    else:
        name, said = by_staleness(m)
        reasons.append(said)
    replay, said = routing_replay(m)
    if replay is not None:
        reasons.append(said)
    return {"strategy": name, "reasons": reasons, "routing_replay": replay, "exactness_matters": matters}
