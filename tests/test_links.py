"""Slow links as a benchmark dimension: the link profiles' arithmetic, the bench's pure
figures (time to a loss from loss curves), the ``auto`` mode decision, the 4-bit codec,
and a smoke run of ``moshray bench links --short`` on separate hosts."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moshray.actors.replica.mode_choice import (
    AMORTISED_SHARE,
    MAX_LOCAL_STEPS,
    MIN_LOCAL_STEPS,
    choose_mode,
)
from moshray.cluster.collective.codecs import (
    BLOCK4,
    codec_names,
    decode,
    encode,
    get_codec,
    max_abs_error_bound,
)
from moshray.jobs.bench.links import (
    Curve,
    compare_figures,
    figures,
    grid_cross_zone_fall,
    loss_at,
    median_step_s,
    smoothed,
    steps_to_target,
    time_to_target,
    zone_layout,
)
from moshray.jobs.local import links

# ----------------------------------------------------------------------- profiles


def test_real_case_arithmetic() -> None:
    # 1B parameters in fp16 over 2.5 Gbit/s: 16 Gbit / 2.5 Gbit/s = 6.4 s per exchange
    assert links.REAL_WIRE_BYTES == 2e9
    assert links.REAL_EXCHANGE_S == pytest.approx(6.4)
    assert links.REAL_RATIO == pytest.approx(6.4)


def test_rate_reproduces_the_ratio() -> None:
    wire, compute = 200_000, 0.05
    mbit = links.mbit_for_ratio(wire, compute, links.REAL_RATIO)
    assert mbit == pytest.approx(5.0)  # 1.6 Mbit in 6.4 x 0.05 s
    exchange_s = wire * 8 / (mbit * 1e6)
    assert exchange_s / compute == pytest.approx(links.REAL_RATIO)


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), "3"])
def test_rate_rejects_bad_input(bad) -> None:
    with pytest.raises(ValueError, match="must be a positive number"):
        links.mbit_for_ratio(bad, 0.05, 1.0)


def test_profiles_shape_the_links() -> None:
    wire, compute = 200_000, 0.05
    assert links.node_rates(links.get_profile("fast"), 3, wire, compute) == (None,) * 3
    slow = links.node_rates(links.get_profile("slow"), 3, wire, compute)
    assert slow == (5.0, 5.0, 5.0)
    straggler = links.node_rates(links.get_profile("straggler"), 3, wire, compute)
    assert straggler[:2] == (50.0, 50.0) and straggler[2] == 5.0  # one link 10x slower
    zones = links.node_rates(links.get_profile("zones"), 3, wire, compute)
    assert zones == (None, None, 5.0)  # zone A not shaped, zone B behind the slow link
    with pytest.raises(ValueError, match="unknown link profile 'lan'; choose one of fast"):
        links.get_profile("lan")
    with pytest.raises(ValueError, match="at least 1 node"):
        links.get_profile("slow").node_ratios(0)


def test_a_profile_laid_onto_slots_crosses_processes_and_configures_a_cluster() -> None:
    from moshray.jobs.local.cluster import LocalClusterConfig

    laid = links.lay_out(links.get_profile("zones"), 3, 200_000, 0.05)
    # zone B's slow link joins its bridge to zone A's; no node's own link is shaped
    assert laid.mbit == (None, None, None) and laid.zones == ((0, "a"), (1, "a"), (2, "b"))
    assert laid.zone_links == (("b", 5.0),) and laid.slowest == 5.0
    assert links.NodeLinks.from_json(laid.to_json()) == laid
    fields = laid.cluster_fields()
    assert fields == {"link_mbit": (), "zones": laid.zones, "zone_links": (("b", 5.0),)}
    assert LocalClusterConfig(hosts="netns", **fields).zone_links == (("b", 5.0),)
    with pytest.raises(ValueError, match="needs hosts='netns'"):
        LocalClusterConfig(**fields)
    with pytest.raises(ValueError, match="zone_links: zone 'c' has no slot in zones"):
        LocalClusterConfig(hosts="netns", zones=laid.zones, zone_links=(("c", 5.0),))
    straggler = links.lay_out(links.get_profile("straggler"), 3, 200_000, 0.05)
    assert straggler.cluster_fields()["link_mbit"] == ((0, 50.0), (1, 50.0), (2, 5.0))
    assert LocalClusterConfig(hosts="netns", **straggler.cluster_fields()).link_mbit[2] == \
        (2, 5.0)
    with pytest.raises(ValueError, match="needs hosts='netns'"):
        LocalClusterConfig(link_mbit=((2, 5.0),))
    with pytest.raises(ValueError, match="slot 1's rate must be a positive"):
        LocalClusterConfig(hosts="netns", link_mbit=((1, 0),))
    with pytest.raises(ValueError, match="not a NodeLinks"):
        links.NodeLinks.from_json('{"mbit": []}')


def test_each_profile_is_compared_against_its_one_uneven_thing_removed() -> None:
    straggler = links.lay_out(links.get_profile("straggler"), 3, 200_000, 0.05)
    assert links.baseline(straggler) == ("even", links.NodeLinks("straggler", (50.0,) * 3))
    zones = links.lay_out(links.get_profile("zones"), 3, 200_000, 0.05)
    assert links.baseline(zones) == ("zone_blind", zones)  # same links and labels ...
    assert links.BASELINE_SETS["zone_blind"] == ("training.zone_aware=false",)  # grid blind
    with pytest.raises(ValueError, match="nothing to compare"):
        links.baseline(links.lay_out(links.get_profile("slow"), 3, 200_000, 0.05))


def test_median_step_is_robust_to_one_slow_step() -> None:
    assert median_step_s([(0.0, 1), (1.0, 1), (2.0, 1), (9.0, 1)]) == 1.0
    assert median_step_s([(0.0, 1), (1.0, 1), (3.0, 1)]) == 1.5
    assert median_step_s([(0.0, 1)]) is None


def test_compare_figures_give_step_time_rise_and_the_last_links_bytes_fall() -> None:
    from dataclasses import replace

    def curve(step_s: float, steps: int, last_bytes: float) -> Curve:
        return Curve("x", tuple((i * step_s, 3.0) for i in range(steps)),
                     bytes_by_node=(1.0, 1.0, last_bytes))

    runs = {"even": {"ddp": curve(1.0, 11, 1000), "collaborative": curve(2.0, 11, 4400)},
            "straggler": {"ddp": curve(4.0, 11, 1000), "collaborative": curve(2.2, 11, 2200)}}
    out = compare_figures("straggler", "even", runs)
    assert out["step_time_rise"] == {"collaborative": 0.1, "ddp": 3.0}
    assert out["last_link_bytes_fall"] == {"collaborative": 2.0, "ddp": 1.0}
    assert out["systems"]["ddp"]["even"] == {"steps": 11, "peers_per_step": None,
                                             "median_step_s": 1.0,
                                             "last_link_bytes_per_step": 90,
                                             "cross_zone_bytes_per_step": None,
                                             "averaged_cross_zone_bytes_per_step": None}
    runs["straggler"]["ddp"] = replace(runs["straggler"]["ddp"], peers=(3, 2, 2, 3, 2))
    assert compare_figures("straggler", "even", runs)["systems"]["ddp"]["straggler"][
        "peers_per_step"] == 2
    # a run that failed (or made one step) leaves its figures None, not an error
    out = compare_figures("straggler", "even", {"even": {"ddp": curve(1.0, 1, 9)}})
    assert out["step_time_rise"] == {"ddp": None}
    assert out["systems"]["ddp"]["straggler"]["steps"] == 0


def test_the_grid_predicts_the_cross_zone_fall_of_a_layout() -> None:
    assert grid_cross_zone_fall(((0, "a"), (1, "a"), (2, "b"))) == pytest.approx(4 / 3, 1e-3)
    assert grid_cross_zone_fall(((0, "a"), (1, "a"), (2, "b"), (3, "b"))) == 2.0
    assert grid_cross_zone_fall(((0, "a"), (1, "a"))) is None


def test_zone_b_takes_the_last_nodes_behind_the_slow_link() -> None:
    laid = links.lay_out(links.get_profile("zones"), 4, 200_000, 0.05)
    two = zone_layout(laid, 2)
    assert two.mbit == (None,) * 4 and two.zone_links == laid.zone_links  # one link between
    assert two.zones == ((0, "a"), (1, "a"), (2, "b"), (3, "b"))
    assert zone_layout(laid, 1) == laid
    assert links.baseline(two) == ("zone_blind", two)
    for bad in (0, 4):
        with pytest.raises(ValueError, match="zone B needs 1 to 3 of 4 nodes"):
            zone_layout(laid, bad)


def test_compare_figures_give_the_bytes_across_the_zones() -> None:
    def curve(cross: float | None, averaged: float | None = None) -> Curve:
        return Curve("x", tuple((float(i), 3.0) for i in range(10)), bytes_by_node=(1.0, 9.0),
                     cross_zone_bytes=cross, averaged_cross_zone_bytes=averaged)

    out = compare_figures("zones", "zone_blind",
                          {"zone_blind": {"collaborative": curve(4000, 3000)},
                           "zones": {"collaborative": curve(2000, 1500)}})
    assert out["cross_zone_bytes_fall"] == {"collaborative": 2.0}
    assert out["averaged_cross_zone_bytes_fall"] == {"collaborative": 2.0}
    assert out["systems"]["collaborative"]["zone_blind"][
        "averaged_cross_zone_bytes_per_step"] == 300
    assert out["systems"]["collaborative"]["zones"]["cross_zone_bytes_per_step"] == 200
    out = compare_figures("zones", "zone_blind", {"zone_blind": {"collaborative": curve(None)},
                                                  "zones": {"collaborative": curve(None)}})
    assert "cross_zone_bytes_fall" not in out and "averaged_cross_zone_bytes_fall" not in out
    assert out["systems"]["collaborative"]["zones"]["cross_zone_bytes_per_step"] is None


def _netns_unavailable() -> str | None:
    from moshray.jobs.local.netns import unavailable

    return unavailable()


@pytest.mark.skipif(_netns_unavailable() is not None,
                    reason=_netns_unavailable() or "netns available")
def test_a_zone_bridge_keeps_its_traffic_inside_and_counts_what_crosses() -> None:
    """Zone B's two nodes on a bridge of their own (``HostNetwork.add_zone``), joined to
    the head's by one link: datagrams between them do not cross it; from zone B to the head
    (zone A) and back they do, each frame once, at its full length (``ZoneBytes``)."""
    import socket
    import time
    from types import SimpleNamespace

    from moshray.jobs.bench.links import ZoneBytes
    from moshray.jobs.local.netns import HostNetwork

    def in_ns(host, code: str) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", host.namespace, sys.executable, "-c",
                                 code])

    def listen(host) -> subprocess.Popen:  # three datagrams on port 9, then exit
        return in_ns(host, "import socket; s = socket.socket(2, 2); s.bind(('0.0.0.0', 9)); "
                           "s.settimeout(20); [s.recv(2000) for _ in range(3)]")

    def send(host, address: str) -> None:
        in_ns(host, f"import socket; s = socket.socket(2, 2); "
                    f"[s.sendto(b'x' * 1000, ({address!r}, 9)) for _ in range(3)]"
              ).wait(timeout=30)

    frame = 14 + 20 + 8 + 1000  # Ethernet, IPv4, UDP, payload
    with HostNetwork() as net:
        net.add_zone("b", None)
        hosts = [net.add_host(0), net.add_host(1, "b"), net.add_host(2, "b")]
        crossing = ZoneBytes(SimpleNamespace(net=net), "b")
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as head:
            head.bind((net.head_address, 9))
            head.settimeout(20)
            # Warm-up: the bridges learn every address (until then a frame to an unknown
            # one is flooded to every port, the zone's link too), ARP is answered.
            send(hosts[1], net.head_address)
            send(hosts[2], net.head_address)
            for _ in range(6):
                head.recv(2000)
            send(hosts[1], hosts[2].address)  # (nobody listens yet: an ICMP error back)
            send(hosts[2], hosts[1].address)
            time.sleep(0.6)
            start = crossing.read()
            inside = listen(hosts[2])
            time.sleep(1.0)
            send(hosts[1], hosts[2].address)  # inside zone B: its bridge only
            assert inside.wait(timeout=30) == 0
            time.sleep(0.6)
            assert crossing.read() - start < frame  # (at most a stray report)
            start = crossing.read()
            send(hosts[1], net.head_address)  # zone B -> the head (zone A)
            for _ in range(3):
                head.recv(2000)
            across = listen(hosts[2])
            time.sleep(1.0)
            for _ in range(3):  # the head -> zone B
                head.sendto(b"x" * 1000, (hosts[2].address, 9))
            assert across.wait(timeout=30) == 0
            time.sleep(0.6)
            assert 6 * frame <= crossing.read() - start < 7 * frame


# ----------------------------------------------------------------------- figures


def _curve(losses, dt=1.0):
    return tuple((i * dt, loss) for i, loss in enumerate(losses))


def test_time_to_target_uses_the_smoothed_curve() -> None:
    pts = _curve([5, 1, 5, 5, 2, 2, 2, 2])
    assert smoothed(pts, 2)[1] == (1.0, 3.0)
    # one lucky step (1.0) does not count; the mean of two reaches 2 at t=5
    assert time_to_target(pts, 2.0, window=2) == 5.0
    assert steps_to_target(pts, 2.0, window=2) == 6
    assert time_to_target(pts, 0.5, window=2) is None
    assert loss_at(pts, 4.5, window=1) == 2 and loss_at(pts, -1.0) is None
    with pytest.raises(ValueError, match="window"):
        smoothed(pts, 0)


def test_figures_compare_against_ddp() -> None:
    ddp = Curve("ddp", _curve([4, 3.5, 3, 2.5, 2, 2, 2, 2], dt=10.0), bytes_per_node=8e6)
    fast = Curve("diloco8", _curve([4, 3, 2, 1.8, 1.7, 1.6], dt=5.0), bytes_per_node=6e5)
    never = Curve("collaborative", _curve([4, 4, 4], dt=10.0), bytes_per_node=4e6)
    out = figures("slow", {"ddp": ddp, "diloco8": fast, "collaborative": never},
                  (5.0, 5.0), window=1)
    assert out["target_loss"] == 2.0 and out["ddp_time_to_target_s"] == 40.0
    assert out["moshray_mode"] == "diloco8" and out["moshray_time_to_target_s"] == 10.0
    assert out["time_to_target_vs_ddp"] == 0.25
    assert out["modes"]["collaborative"]["time_to_target_s"] is None
    assert out["modes"]["diloco8"]["bytes_per_node_to_target"] == int(6e5 * 3 / 6)
    assert out["equal_time_s"] == 20.0  # the shortest run's end
    assert out["modes"]["ddp"]["loss_at_equal_time"] == 3.0
    assert out["modes"]["diloco8"]["held_out_loss"] is None  # (no final evaluation)
    json.dumps(out)
    with pytest.raises(ValueError, match="DDP run recorded no step"):
        figures("slow", {"diloco8": fast}, (None,))


def test_the_target_is_the_best_baselines_final_loss() -> None:
    # DDP ends at 2.0, PowerSGD at 1.8 (the best baseline), torchft's DiLoCo at 1.9;
    # diloco8 reaches 1.8 at 15 s, PowerSGD at 50 s: 0.3 of the best baseline's time
    ddp = Curve("ddp", _curve([4, 3.5, 3, 2.5, 2, 2, 2, 2], dt=10.0), 8e6, ((70.0, 2.5),))
    psgd = Curve("ddp_powersgd", _curve([4, 3.5, 3, 2.5, 2.2, 1.8, 1.8], dt=10.0), 2e6,
                 ((60.0, 2.3),))
    ft = Curve("torchft_diloco", _curve([4, 3, 2.5, 1.9, 1.9], dt=10.0), 1e6)
    fast = Curve("diloco8", _curve([4, 3, 2, 1.8, 1.7, 1.6], dt=5.0), 6e5, ((25.0, 2.2),))
    out = figures("slow", {"ddp": ddp, "ddp_powersgd": psgd, "torchft_diloco": ft,
                           "diloco8": fast}, (5.0, 5.0), window=1)
    assert out["best_baseline"] == "ddp_powersgd" and out["target_loss"] == 1.8
    assert out["best_baseline_time_to_target_s"] == 50.0
    assert out["moshray_mode"] == "diloco8" and out["moshray_time_to_target_s"] == 15.0
    assert out["time_to_target_vs_best_baseline"] == 0.3
    assert out["ddp_time_to_target_s"] is None and out["time_to_target_vs_ddp"] is None
    assert out["held_out_loss"] == 2.2 and out["best_baseline_held_out_loss"] == 2.3
    # the baselines are never the best mode, however fast
    assert "torchft_diloco" in out["modes"] and out["moshray_mode"] != "torchft_diloco"
    json.dumps(out)


def test_final_models_held_out_losses_are_reported_beside_the_training_curves_times() -> None:
    # DDP's final model: 2.5 held out; diloco8's 2.4; the target stays DDP's training loss
    ddp = Curve("ddp", _curve([4, 3.5, 3, 2.5, 2, 2, 2, 2], dt=10.0), 8e6, ((70.0, 2.5),))
    fast = Curve("diloco8", _curve([4, 3, 2, 1.8, 1.7, 1.6], dt=5.0), 6e5, ((25.0, 2.4),))
    lost = Curve("diloco_overlap", _curve([4, 3.5], dt=10.0), 1e6)  # final state not found
    out = figures("slow", {"ddp": ddp, "diloco8": fast, "diloco_overlap": lost}, (5.0, 5.0),
                  window=1)
    assert out["target_loss"] == 2.0 and out["ddp_held_out_loss"] == 2.5
    modes = out["modes"]
    assert modes["ddp"]["time_to_target_s"] == 40.0 and modes["diloco8"]["time_to_target_s"] == 10.0
    assert modes["diloco8"]["held_out_loss"] == 2.4
    assert modes["diloco_overlap"]["held_out_loss"] is None
    assert out["moshray_mode"] == "diloco8" and out["time_to_target_vs_ddp"] == 0.25
    json.dumps(out)


def test_each_run_gets_its_final_models_held_out_loss(tmp_path: Path) -> None:
    """``with_held_out`` on real files: a DDP state file and a moshray run's saved model
    (``save_model``) of the short model, evaluated on a small corpus; a run whose final
    model is missing is named."""
    import torch

    from moshray.jobs.bench.goodput_runs import held_out_loss
    from moshray.jobs.bench.links import SHORT_MODEL, _config, with_held_out
    from moshray.jobs.examples.lm.model import build_model

    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(bytes(np.random.default_rng(0).integers(32, 127, 60_000, dtype=np.uint8)))
    config = _config((*SHORT_MODEL, "cluster.max_nodes=2"))
    model = build_model(config.model.to_model_config(), seed=0)
    torch.save({"model": model.state_dict()}, tmp_path / "state.pt")
    moved = {k: v + 0.01 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    torch.save(moved, tmp_path / "model.pt")
    curves = {"ddp": Curve("ddp", _curve([4, 3])), "diloco8": Curve("diloco8", _curve([4, 2])),
              "diloco4": Curve("diloco4", _curve([4, 2]))}
    finals = {"ddp": str(tmp_path / "state.pt"), "diloco8": tmp_path / "model.pt",
              "diloco4": tmp_path / "nothing-here.pt"}
    out, missing = with_held_out(curves, finals, config, [str(corpus)])
    ddp_loss = held_out_loss(config, [str(corpus)], model.state_dict())
    assert out["ddp"].held_out == ((1.0, ddp_loss),)
    assert out["diloco8"].held_out[0][0] == 1.0
    assert out["diloco8"].held_out[0][1] == held_out_loss(config, [str(corpus)], moved)
    assert out["diloco4"].held_out == () and list(missing) == ["diloco4"]


# ----------------------------------------------------------------------- auto mode


def test_auto_picks_collaborative_on_fast_links() -> None:
    # 200 kB over 10 Gbit/s: 0.16 ms against 50 ms of compute
    choice = choose_mode(10e9, 200_000, 0.05)
    assert choice.mode == "collaborative" and choice.local_steps is None
    assert "fast enough" in choice.line and "\n" not in choice.line


def test_auto_picks_diloco_where_averaging_is_the_bottleneck() -> None:
    # the real case: 2 GB over 2.5 Gbit/s = 6.4 s against 1 s of compute
    choice = choose_mode(2.5e9, 2e9, 1.0)
    assert choice.mode == "local_sgd"
    assert choice.exchange_s == pytest.approx(6.4)
    assert choice.sync_share == pytest.approx(6.4 / 7.4)
    assert choice.local_steps == 64  # 6.4 s is a tenth of 64 steps' compute
    assert choice.exchange_s / (choice.local_steps * 1.0) <= AMORTISED_SHARE
    assert "bottleneck" in choice.line and "local_steps=64" in choice.line


def test_auto_local_steps_are_bounded() -> None:
    assert choose_mode(1e9, 5e6, 0.1).local_steps == MIN_LOCAL_STEPS  # share 29%: few steps
    assert choose_mode(1e6, 2e9, 0.01).local_steps == MAX_LOCAL_STEPS


@pytest.mark.parametrize("args", [(0, 1, 1), (1, -1, 1), (1, 1, float("inf"))])
def test_auto_rejects_bad_input(args) -> None:
    with pytest.raises(ValueError, match="must be a positive finite number"):
        choose_mode(*args)


# ----------------------------------------------------------------------- 4-bit codec


@pytest.mark.parametrize("numel", [1, 2, 3, BLOCK4 - 1, BLOCK4, BLOCK4 + 1, 100_001])
def test_blockwise4_round_trip_within_bound(numel: int) -> None:
    x = np.random.default_rng(numel).standard_normal(numel).astype(np.float32)
    enc = encode(x, "blockwise4")
    assert enc.data.dtype == np.uint8 and enc.data.shape == ((numel + 1) // 2,)
    assert enc.data.shape == (get_codec("blockwise4").wire_length(numel),)
    y = decode(enc)
    assert y.dtype == np.float32 and y.shape == x.shape
    assert np.abs(y - x).max() <= max_abs_error_bound(x, "blockwise4")
    blocks = -(-numel // BLOCK4)
    assert enc.nbytes == (numel + 1) // 2 + 8 * blocks  # about half of blockwise8's bytes


def test_blockwise4_is_registered_and_keeps_non_finite() -> None:
    assert "blockwise4" in codec_names()
    x = np.ones(600, np.float32)
    x[300] = np.nan
    y = decode(encode(x, "blockwise4"))
    assert not np.isfinite(y[BLOCK4:2 * BLOCK4]).any()  # the NaN's block
    assert np.isfinite(y[:BLOCK4]).all()
    bad = encode(x, "blockwise4")
    from dataclasses import replace

    with pytest.raises(ValueError, match="4-bit payload"):
        decode(replace(bad, data=bad.data[:-1]))


# ----------------------------------------------------------------------- smoke run


def test_the_held_out_check_sets_a_part_of_the_baselines_time_against_its_held_out_loss(
        ) -> None:
    from moshray.jobs.bench.links import held_out_check, steps_within

    ddp = Curve("ddp", _curve([4, 3, 3, 3, 3, 3, 3, 3, 3, 3]), held_out=((9.0, 2.5),))
    assert steps_within(ddp.points, 3.0) == 4  # t = 0, 1, 2, 3
    rerun = Curve("diloco8_held_out", _curve([4, 3, 2]), held_out=((2.0, 2.4),))
    out = held_out_check("diloco8", ddp, rerun, 1 / 3)
    assert out == {"mode": "diloco8", "baseline": "ddp", "fraction": 1 / 3, "steps": 3,
                   "wall_s": 2.0, "baseline_wall_s": 9.0, "time_vs_baseline": 0.222,
                   "held_out_loss": 2.4, "baseline_held_out_loss": 2.5, "met": True}
    worse = Curve("x", _curve([4, 3, 2]), held_out=((2.0, 2.6),))
    assert held_out_check("diloco8", ddp, worse, 1 / 3)["met"] is False
    slower = Curve("x", _curve([4] * 6), held_out=((5.0, 2.0),))  # 5 s > 9 s / 3
    assert held_out_check("diloco8", ddp, slower, 1 / 3)["met"] is False
    assert held_out_check("diloco8", ddp, Curve("x", _curve([4, 3])), 1 / 3)["met"] is None


@pytest.mark.cluster
def test_bench_links_short_smoke(tmp_path: Path) -> None:
    """``moshray bench links --short`` on separate hosts, DDP and torchft's Streaming DiLoCo
    (Ray Train + torchft, two fragments) against ``training.mode = "auto"``: one JSON line
    with the three runs, the best baseline's target, and the auto job's one line with its
    choice."""
    from moshray.jobs.local import netns

    why = netns.unavailable()
    if why:
        pytest.skip(f"separate hosts unavailable: {why}")
    if os.environ.get("MOSHRAY_SKIP_LINKS_SMOKE"):
        pytest.skip("MOSHRAY_SKIP_LINKS_SMOKE is set")
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "moshray.jobs.cli", "bench", "links", "--profile", "slow",
         "--short", "--seconds", "15", "--systems", "ddp,torchft_streaming_diloco,auto", "--out", str(tmp_path),
         "--held-out-fraction", "0", "--json"], capture_output=True, text=True, timeout=600,
        env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["profile"] == "slow" and result["nodes"] == 2
    assert all(r is not None and r > 0 for r in result["link_mbit"])
    modes = ("ddp", "torchft_streaming_diloco", "auto")
    assert all(result["modes"][m]["steps"] > 0 for m in modes), result["modes"]
    assert result["modes"]["auto"]["bytes_per_node"] > 0
    # torchft's outer steps crossed the shaped links too
    assert result["modes"]["torchft_streaming_diloco"]["bytes_per_node"] > 0
    assert result["best_baseline"] in ("ddp", "torchft_streaming_diloco")
    assert result["target_loss"] == result["modes"][result["best_baseline"]]["final_loss"]
    assert result["failed"] == {}, result["failed"]
    # both final models evaluated on the held-out data: moshray's saved by its job
    # (save_model) on the driver's machine, though its replicas ran on other hosts
    assert result["held_out_missing"] == {}, result["held_out_missing"]
    assert all(0 < result["modes"][m]["held_out_loss"] < 10 for m in modes)
    assert "held_out_check" not in result  # (--held-out-fraction 0)
    assert Path(result["plot"]).exists()
    chosen = [line for line in (tmp_path / "auto" / "driver.log").read_text().splitlines()
              if line.startswith("training.mode auto: ")]
    assert len(chosen) == 1, chosen
    # the slow profile makes averaging the bottleneck: the job measured that and chose DiLoCo
    assert chosen[0].startswith("training.mode auto: local_sgd"), chosen


def test_auto_choice_resolves_the_training_section() -> None:
    from moshray.jobs.config import TrainConfig
    from moshray.actors.replica.mode_choice import resolve_training as resolved
    from moshray.jobs.controller.mode_probe import probe_bytes

    training = TrainConfig.from_dict({"training": {"mode": "auto"}}).training
    slow = resolved(training, choose_mode(2.5e9, 2e9, 1.0))
    assert (slow.mode, slow.local_steps, slow.outer_optimizer) == ("local_sgd", 64, "nesterov")
    assert (slow.outer_lr, slow.outer_momentum) == (0.4, 0.7)  # fit for 64 local steps
    assert slow.wire_codec == "none"  # local SGD's default: full-precision parameters
    fast = resolved(training, choose_mode(10e9, 2e5, 0.05))
    assert fast.mode == "collaborative" and fast.wire_codec == "fp16"
    assert probe_bytes(10) == 1 << 20 and probe_bytes(1e12) == 16 << 20
    with pytest.raises(ValueError, match="training.mode: must be one of"):
        TrainConfig.from_dict({"training": {"mode": "automatic"}})


@pytest.mark.parametrize("n,max_group,size", [(3, 16, 1001), (4, 2, 10_001)],
                         ids=["one-group-odd", "grid-2x2"])
def test_blockwise4_through_the_round(n: int, max_group: int, size: int) -> None:
    """The 4-bit codec (half a byte per value on the wire) through the real ``GroupRound``
    without Ray: every peer ends with the same bits, within two encodings of the exact
    weighted average, and no contribution is rejected (packed payload lengths pass)."""
    import asyncio

    from test_allreduce_local import inputs, reduce_all, swarm, weighted

    _, averagers, plan = swarm(n, max_group=max_group, compression="blockwise4")
    arrays, weights = inputs(n, size=size, seed=5)
    results = asyncio.run(reduce_all(averagers, plan, arrays, weights))
    expected = weighted(arrays, weights, arrays)
    first = results["p0"][0]
    spread = max(float(a.max() - a.min()) for a in arrays.values())
    rounds = len(plan.grid.rounds)
    for pid, (out, report) in results.items():
        assert report.rejections == () and report.complete, (pid, report)
        assert np.array_equal(out, first), pid
        # each round encodes twice (contribution, result): half a step of 15 levels each
        assert np.abs(out - expected).max() <= 2 * rounds * spread / 30 + 1e-3, pid


@pytest.mark.parametrize("args, needle", [
    (["--profile", "slow"], "--compare takes --profile straggler or zones"),
    (["--profile", "straggler", "--systems", "diloco4"], "--compare runs only ddp"),
    (["--profile", "zones", "--nodes", "9"], "--nodes must be 2..8"),
    (["--profile", "straggler", "--zone-b", "2"], "--zone-b goes with --compare --profile zones"),
    (["--profile", "zones", "--nodes", "3", "--zone-b", "3"], "--zone-b must be 1..2"),
])
def test_compare_refuses_what_it_cannot_run_with_one_line(args, needle, capsys) -> None:
    from moshray.jobs.cli import main

    assert main(["bench", "links", "--compare", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err
