"""The goodput simulator (ckptless_hpc.tools.sim): closed forms, optimum interval, Monte Carlo, CLI."""

from __future__ import annotations

import json
import math

import pytest

from ckptless_hpc.tools import sim

pytestmark = pytest.mark.timeout(10)


def test_llama3_rate_and_mtbf():
    rate = sim.llama3_failures_per_gpu_hour()
    assert rate == pytest.approx(419 / (54 * 24 * 16384))
    # the whole 16,384-GPU job: 54 days / 419 interruptions = 3.09 hours between failures
    assert sim.mtbf_s(16384, rate) / 3600 == pytest.approx(54 * 24 / 419)
    assert sim.mtbf_s(32768, rate) == pytest.approx(sim.mtbf_s(16384, rate) / 2)


def test_young_and_daly_agree_with_the_numeric_optimum_when_checkpoints_are_cheap():
    m, c, r = 3 * 3600.0, 10.0, 120.0
    tau = sim.optimal_interval_s(c, r, m)
    assert sim.young_interval_s(c, m) == pytest.approx(math.sqrt(2 * c * m))
    assert tau == pytest.approx(sim.daly_interval_s(c, m), rel=0.01)
    assert tau == pytest.approx(sim.young_interval_s(c, m), rel=0.05)
    best = sim.ckpt_restart_goodput(tau, c, r, m)
    for other in (tau / 2, tau * 2, sim.young_interval_s(c, m) * 1.3):
        assert sim.ckpt_restart_goodput(other, c, r, m) < best


def test_daly_interval_is_the_mtbf_when_a_checkpoint_costs_more_than_two_mtbf():
    assert sim.daly_interval_s(save_s=500.0, mtbf=200.0) == 200.0


def test_first_order_waste():
    m = 10_000.0
    assert sim.checkpointless_goodput(10.0, m) == pytest.approx(1 - 10.0 / m, abs=1e-6)
    p = sim.compare(16384, sim.Costs(steady_overhead=0.02))
    assert p.checkpointless_throughput == pytest.approx(0.98 * p.checkpointless_goodput)
    assert sim.simulate_checkpointless(10.0, m, 3000 * m, seed=1, steady_overhead=0.02) == pytest.approx(0.98 * math.exp(-1e-3), rel=0.01)
    c, r = 5.0, 60.0
    tau = sim.optimal_interval_s(c, r, m)
    # waste ~ C/tau + (tau/2 + R)/M to first order
    assert 1 - sim.ckpt_restart_goodput(tau, c, r, m) == pytest.approx(c / tau + (tau / 2 + r) / m, rel=0.05)


@pytest.mark.parametrize("downtime_s, mtbf", [(5.0, 600.0), (300.0, 1000.0)])
def test_checkpointless_closed_form_matches_the_monte_carlo(downtime_s, mtbf):
    mc = sim.simulate_checkpointless(downtime_s, mtbf, work_s=3000 * mtbf, seed=7)
    assert mc == pytest.approx(sim.checkpointless_goodput(downtime_s, mtbf), rel=0.01)


@pytest.mark.parametrize("save_s, restart_s, mtbf", [(2.0, 15.0, 600.0), (60.0, 200.0, 1000.0)])
def test_ckpt_restart_closed_form_matches_the_monte_carlo(save_s, restart_s, mtbf):
    tau = sim.optimal_interval_s(save_s, restart_s, mtbf)
    mc = sim.simulate_ckpt_restart(tau, save_s, restart_s, mtbf, work_s=3000 * mtbf, seed=7)
    assert mc == pytest.approx(sim.ckpt_restart_goodput(tau, save_s, restart_s, mtbf), rel=0.01)


def test_monte_carlo_is_deterministic_per_seed():
    a = sim.simulate_ckpt_restart(30.0, 1.0, 10.0, 300.0, 1e5, seed=3)
    assert a == sim.simulate_ckpt_restart(30.0, 1.0, 10.0, 300.0, 1e5, seed=3)
    assert a != sim.simulate_ckpt_restart(30.0, 1.0, 10.0, 300.0, 1e5, seed=4)


def test_goodput_falls_with_scale_and_checkpointless_stays_ahead():
    costs = sim.Costs(detect_s=3.0, reconfigure_s=0.2, transfer_s=0.5, resume_s=1.5, save_s=5.0, restart_s=60.0)
    points = sim.sweep(costs, [1024, 16384, 100000])
    for a, b in zip(points, points[1:]):
        assert b.checkpointless_goodput < a.checkpointless_goodput
        assert b.ckpt_restart_goodput < a.ckpt_restart_goodput
        assert b.interval_s < a.interval_s
    for p in points:
        assert p.checkpointless_goodput > p.ckpt_restart_goodput


def test_group_formation_grows_per_doubling_for_both_systems():
    costs = sim.Costs(detect_s=1.0, reconfigure_s=0.5, transfer_s=0.0, resume_s=0.0, restart_s=10.0, group_init_per_doubling_s=0.25, ref_gpus=2)
    assert costs.downtime_s(2) == pytest.approx(1.5)
    assert costs.downtime_s(1) == pytest.approx(1.5)  # never below the measured cost
    assert costs.downtime_s(16) == pytest.approx(1.5 + 3 * 0.25)
    assert costs.restart_at_s(16) == pytest.approx(10.0 + 3 * 0.25)


@pytest.mark.parametrize(
    "kw, field",
    [({"detect_s": -1.0}, "detect_s"), ({"steady_overhead": 1.5}, "steady_overhead"), ({"save_s": 0.0}, "save_s"), ({"restart_s": float("nan")}, "restart_s")],
)
def test_bad_costs_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        sim.compare(16384, sim.Costs(**kw))


def test_bad_gpu_count_and_rate():
    with pytest.raises(ValueError, match="gpus"):
        sim.mtbf_s(0, 1e-5)
    with pytest.raises(ValueError, match="failures_per_gpu_hour"):
        sim.mtbf_s(8, 0.0)


def test_cli_table_and_json(capsys):
    assert sim.main(["--gpus", "16384", "--json", "--restart-s", "120"]) == 0
    out = json.loads(capsys.readouterr().out)
    (p,) = out["points"]
    assert p["gpus"] == 16384 and out["costs"]["restart_s"] == 120.0
    assert 0 < p["ckpt_restart_goodput"] < p["checkpointless_goodput"] < 1
    assert sim.main(["--gpus", "1024", "--gpus", "100000"]) == 0
    text = capsys.readouterr().out
    assert "1024" in text and "100000" in text and "goodput" in text
    assert sim.main(["--detect-s", "-3"]) == 2
    assert "detect_s" in capsys.readouterr().err


def test_the_defaults_keep_the_measured_transfer():
    c = sim.Costs(detect_s=1.0, reconfigure_s=0.1, transfer_s=0.6, resume_s=1.0, group_init_per_doubling_s=0.0)
    assert c.critical_transfer_s() == pytest.approx(0.6) and c.downtime_s(1024) == pytest.approx(2.7)


def test_several_sources_add_up_until_the_receivers_link_is_full():
    one = sim.Costs(state_gb=1.2, source_gb_per_s=2.4)
    assert one.fetch_s() == pytest.approx(0.5)  # the measured transfer_s is ignored once bytes and rate are given
    assert sim.Costs(state_gb=1.2, source_gb_per_s=2.4, sources=4).fetch_s() == pytest.approx(0.125)
    capped = sim.Costs(state_gb=1.2, source_gb_per_s=2.4, sources=4, link_gb_per_s=6.0)
    assert capped.fetch_s() == pytest.approx(0.2)


def test_parameters_first_hides_the_rest_behind_the_first_steps_compute():
    c = sim.Costs(transfer_s=0.6, params_fraction=1 / 3, overlap_s=0.3)
    assert c.critical_transfer_s() == pytest.approx(0.2 + 0.1)  # 0.4 s of moments, 0.3 s hidden
    assert sim.Costs(transfer_s=0.6, params_fraction=1 / 3, overlap_s=1.0).critical_transfer_s() == pytest.approx(0.2)


@pytest.mark.parametrize("kw, field", [({"sources": 0}, "sources"), ({"params_fraction": 0.0}, "params_fraction"), ({"state_gb": 1.0}, "source_gb_per_s")])
def test_bad_transfer_costs_name_the_field(kw, field):
    with pytest.raises(ValueError, match=field):
        sim.compare(16384, sim.Costs(**kw))
