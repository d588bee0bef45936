"""Tensor-parallel communication overlap: what of a unit's tp collectives the GEMMs beside them hide.

Only a framework that drives them itself hides them (``Framework.tp_comm_overlap``: Transformer Engine's
userbuffers, with sequence parallelism), and then on SMs taken from the products (``tp_overlap_comm_sms``)
and at the clock their power leaves (``autopar.interference``); elsewhere each collective waits between the
GEMMs (DTensor, Megatron-LM's mappings).
"""

from __future__ import annotations

from autopar.cluster import AxisLink, Cluster
from autopar.framework import Framework
from autopar.inter_op.layout import Layout
from autopar.inter_op.technique import Technique, UnitLoadDraft
from autopar.inter_op.unit_costs import UnitCost
from autopar.interference import compute_rate, overlapped_s
from autopar.power import PowerMix


def exposed_tp_s(u: UnitCost, layout: Layout, tp_link: AxisLink, cluster: Cluster, fw: Framework) -> float:
    """The time ``u``'s tensor-parallel collectives (forward and backward) add to it."""
    tp = u.tp_fwd_s + u.tp_bwd_s
    if not (fw.tp_comm_overlap and layout.sp):
        return tp
    mix = u.power  # userbuffers run each collective under the GEMM it feeds
    products = PowerMix(mix.tensor_s, mix.demand_s, 0.0)
    rate = compute_rate(cluster, tp_link, products, fw.tp_overlap_comm_sms or None)
    return overlapped_s(tp, u.product_s, rate)


def _unit_step(d: UnitLoadDraft) -> None:
    u = d.u
    d.tp_s = exposed_tp_s(u, d.layout, d.links.tp, d.cluster, d.ctx.framework)
    tp = u.tp_fwd_s + u.tp_bwd_s
    d.tp_fwd_s = d.tp_s * u.tp_fwd_s / tp if tp > 0 else 0.0


TECHNIQUE = Technique("tp_overlap", unit_step=_unit_step)

__all__ = ["TECHNIQUE", "exposed_tp_s"]
