"""ewma's phi in bf16 (half the host bytes of fp32) with stochastic rounding; on the trainer's device on request."""
import pytest
import torch
from recovery_scorer import HFScorerForTests, LoopState, drive_history, tiny_checkpoint

from recovery._stochastic_round import fold_seed, round_to_bf16
from recovery.ewma import Ewma, EwmaConfig, ewma_update

ULP = 2.0 ** -7  # a bf16 unit in the last place on [1, 2)


def _gen(seed: int = 0) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_representable_values_round_to_themselves():
    x = torch.tensor([0.0, 1.0, -2.5, 1.0 + ULP, -3.0 * 2.0 ** -20])
    assert torch.equal(round_to_bf16(x, _gen()).float(), x)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_a_quarter_unit_rounds_up_a_quarter_of_the_time(sign):
    x = torch.full((200_000,), sign * (1.0 + ULP / 4))  # 1 + 2^-9: a quarter of the way from 1 to 1 + 2^-7
    r = round_to_bf16(x, _gen()).float()
    assert set(r.unique().tolist()) == {sign * 1.0, sign * (1.0 + ULP)}
    up = float((r.abs() > 1.0).float().mean())
    assert up == pytest.approx(0.25, abs=0.005)  # binomial std 0.001
    assert float(r.mean()) == pytest.approx(sign * (1.0 + ULP / 4), abs=0.005 * ULP)  # exact in expectation


def test_the_draws_repeat_with_the_seed():
    x = torch.rand(1000) + 1.0
    assert torch.equal(round_to_bf16(x, _gen(fold_seed(3, 7))), round_to_bf16(x, _gen(fold_seed(3, 7))))
    assert not torch.equal(round_to_bf16(x, _gen(fold_seed(3, 7))), round_to_bf16(x, _gen(fold_seed(3, 8))))


def _follow(theta_at, steps: int, beta: float, mode: str) -> torch.Tensor:
    phi, n = None, 0.0
    for k in range(steps):
        theta = {"w": theta_at(k)}
        if mode == "nearest":  # what a plain bf16 accumulator does: the negative control
            n_new = beta * n + 1.0
            phi = ({"w": theta["w"].to(torch.bfloat16)} if phi is None else
                   {"w": (phi["w"].float() * (beta * n / n_new) + theta["w"] / n_new).to(torch.bfloat16)})
            n = n_new
        else:
            dtype = torch.bfloat16 if mode == "stochastic" else torch.float32
            phi, n = ewma_update(phi, n, theta, beta, dtype=dtype, generator=_gen(fold_seed(0, k)))
    return phi["w"].float()


def test_a_bf16_phi_follows_theta_where_rounding_to_nearest_sticks():
    # theta stays at 1 for 30 steps, then moves one bf16 unit up and keeps still: the fp32 average reaches
    # 1 + ULP; at beta 0.8 phi's weight on theta is 1/n_new = 0.2 by then (n -> 1 / (1 - beta) = 5), so the
    # first increment is 0.2 units, under half a unit: a bf16 phi rounded to nearest never moves off 1.0, a
    # whole unit behind for good
    theta_at = lambda k: torch.full((8192,), 1.0 if k < 30 else 1.0 + ULP)  # noqa: E731
    exact = _follow(theta_at, 90, 0.8, "fp32")
    assert float(exact.mean()) == pytest.approx(1.0 + ULP, abs=1e-4 * ULP)
    assert torch.equal(_follow(theta_at, 90, 0.8, "nearest"), torch.ones(8192))
    sr = _follow(theta_at, 90, 0.8, "stochastic")
    assert float(sr.mean()) == pytest.approx(1.0 + ULP, abs=0.01 * ULP)


def test_a_bf16_phi_tracks_a_drifting_theta_in_expectation():
    # theta climbs 0.05 units a step (an fp32 master weight between bf16 values): after 80 steps the
    # stochastic phi's mean sits within 0.03 units of the fp32 average, each element within 3 units of it
    theta_at = lambda k: torch.full((8192,), 1.0 + 0.05 * ULP * k)  # noqa: E731
    exact, sr = _follow(theta_at, 80, 0.8, "fp32"), _follow(theta_at, 80, 0.8, "stochastic")
    assert float((sr - exact).mean()) == pytest.approx(0.0, abs=0.03 * ULP)
    assert float((sr - exact).abs().max()) <= 3 * ULP
    nearest = _follow(theta_at, 80, 0.8, "nearest")
    assert float((exact - nearest).mean()) > 0.5 * ULP  # the negative control lags by more than half a unit


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("ckpt"))


def _run(ckpt, cfg: EwmaConfig, dtype: str):
    trainer = HFScorerForTests(ckpt, version=7)
    trainer.dtype = dtype  # the run's dtype decides phi's (the scorer's own weights stay fp32)
    loop = LoopState()
    strat = Ewma(cfg, loop.context(trainer))
    batch, trajs, _ = drive_history(strat, trainer, loop)
    strat.anchor(batch, trajs)
    trainer.fake_step()
    strat.after_optimizer_step(trainer.version, {})
    strat.anchor(batch, trajs)  # folds the step's theta in
    return trainer, loop, strat, batch, trajs


def test_a_bf16_run_keeps_phi_at_half_the_bytes_and_float32_on_request(ckpt):
    bf16 = _run(ckpt, EwmaConfig(beta=0.5, tau=0.0), "bfloat16")[2]
    fp32 = _run(ckpt, EwmaConfig(beta=0.5, tau=0.0, phi_dtype="float32"), "bfloat16")[2]
    same = _run(ckpt, EwmaConfig(beta=0.5, tau=0.0), "float32")[2]  # an fp32 run: fp32 phi, as before
    assert {t.dtype for t in bf16._phi.values()} == {torch.bfloat16}
    assert {t.dtype for t in fp32._phi.values()} == {t.dtype for t in same._phi.values()} == {torch.float32}
    assert 2 * bf16.overhead()["bytes_held"] == fp32.overhead()["bytes_held"] == same.overhead()["bytes_held"]
    # near the fp32 average: theta rounded to nearest once, then a stochastic fold (errors relative to the
    # thetas averaged, so a tensor's scale, not each element's: an average of opposite values is near 0)
    for k, t in bf16._phi.items():
        ref, err = fp32._phi[k], (t.float() - fp32._phi[k]).abs()
        assert float(err.mean()) <= 2.0 ** -8 * float(ref.abs().mean())
        assert float(err.max()) <= 2 * 2.0 ** -7 * float(ref.abs().max())


def test_phi_on_gpu_keeps_phi_where_the_parameters_are(ckpt):
    # on this CPU-only machine the parameters' device is the CPU: the request must still give the same
    # anchor as host phi, and get_params(device=None) must be what the strategy asked for
    a = _run(ckpt, EwmaConfig(beta=0.5, tau=0.0, phi_on_gpu=True), "float32")
    b = _run(ckpt, EwmaConfig(beta=0.5, tau=0.0), "float32")
    assert torch.equal(a[2].anchor(a[3], a[4]).logp_anchor, b[2].anchor(b[3], b[4]).logp_anchor)
    device = next(a[0].model.parameters()).device
    assert {t.device for t in a[2]._phi.values()} == {device}


def test_the_fold_inside_the_swap_is_the_host_fold_bit_for_bit_and_takes_no_other_copy(ckpt):
    # a host phi is folded on the parameters' device while the anchor swaps it in (recovery/ewma.py, "Folding"):
    # the same phi as folding on the host after each step, and theta leaves the device once per step, in the
    # swap (before, the fold took a copy of its own: one more shard over PCIe per step, and host arithmetic)
    trainer = HFScorerForTests(ckpt, version=7)
    trainer.dtype = "bfloat16"
    loop = LoopState()
    strat = Ewma(EwmaConfig(beta=0.5, tau=0.0), loop.context(trainer))
    batch, trajs, _ = drive_history(strat, trainer, loop)
    strat.anchor(batch, trajs)  # phi = theta
    ref, n = ewma_update(None, 0.0, trainer.get_params(), 0.5, dtype=torch.bfloat16)
    for _ in range(3):
        trainer.fake_step()
        strat.after_optimizer_step(trainer.version, {})
        gen = torch.Generator()
        gen.manual_seed(fold_seed(0, trainer.version))
        before, n_before, theta = {k: t.clone() for k, t in ref.items()}, n, trainer.get_params()
        ref, n = ewma_update(ref, n, theta, 0.5, dtype=torch.bfloat16, generator=gen)
        copies, swaps = trainer.n_copies, trainer.n_swaps
        with trainer.use_params(ref):
            expected = trainer.logprobs(batch)
        got = strat.anchor(batch, trajs)
        assert trainer.n_copies == copies + 1 and trainer.n_swaps == swaps + 2  # the use_params above only
        assert all(torch.equal(strat._phi[k], ref[k]) for k in ref) and strat._n == n
        assert torch.equal(got.logp_anchor, expected)
    assert not torch.equal(got.logp_anchor, trainer.logprobs(batch))  # the average, not theta
    # negative control: the same fold with another version's draws is not what the strategy holds
    other = torch.Generator()
    other.manual_seed(fold_seed(0, trainer.version + 1))
    wrong, _ = ewma_update(before, n_before, theta, 0.5, dtype=torch.bfloat16, generator=other)
    assert not all(torch.equal(strat._phi[k], wrong[k]) for k in wrong)


def test_phi_on_gpu_is_folded_in_place_and_pointed_at_with_no_copy_of_theta(ckpt):
    # phi on the parameters' device is folded there in place and the forward points the parameters at it
    # (recovery/ewma.py, "Folding"): no copy of theta per step (before, the fold took one, and the swap kept it
    # as its saved copy: a second shard of GPU memory), and the same phi and anchor as a host phi
    trainer = HFScorerForTests(ckpt, version=7)
    host = HFScorerForTests(ckpt, version=7)
    loop, loop_h = LoopState(), LoopState()
    strat = Ewma(EwmaConfig(beta=0.5, tau=0.0, phi_on_gpu=True), loop.context(trainer))
    ref = Ewma(EwmaConfig(beta=0.5, tau=0.0), loop_h.context(host))
    batch, trajs, _ = drive_history(strat, trainer, loop)
    drive_history(ref, host, loop_h)
    strat.anchor(batch, trajs), ref.anchor(batch, trajs)  # phi = theta: the one copy, phi itself
    seen = []
    scored = trainer.logprobs

    def logprobs(b):
        seen.append(next(trainer.model.parameters()).data_ptr())
        return scored(b)

    trainer.logprobs = logprobs
    for _ in range(3):
        trainer.fake_step(), host.fake_step()
        strat.after_optimizer_step(trainer.version, {}), ref.after_optimizer_step(host.version, {})
        copies, seen[:] = trainer.n_copies, []
        got, want = strat.anchor(batch, trajs), ref.anchor(batch, trajs)
        assert trainer.n_copies == copies, "the fold took a copy of theta"
        assert seen == [next(iter(strat._phi.values())).data_ptr()], "the forward did not point at phi"
        assert all(torch.equal(strat._phi[k], ref._phi[k].to(strat._phi[k].device)) for k in ref._phi)
        assert torch.equal(got.logp_anchor, want.logp_anchor)
    assert next(trainer.model.parameters()).data_ptr() != seen[0]  # theta is back


def test_a_checkpoint_between_a_step_and_its_fold_resumes_to_the_same_phi(ckpt):
    # a checkpoint after a step holds phi without that step's theta (the next anchor folds it in): the resumed
    # strategy folds it in from the same theta with the same draws
    trainer, loop, strat, batch, trajs = _run(ckpt, EwmaConfig(beta=0.5, tau=0.0), "bfloat16")
    trainer.fake_step()
    strat.after_optimizer_step(trainer.version, {})
    state = strat.state_dict()
    assert state["phi_version"] == trainer.version - 1
    resumed = Ewma(EwmaConfig(beta=0.5, tau=0.0), loop.context(trainer))
    resumed.load_state_dict(state)
    a, b = strat.anchor(batch, trajs), resumed.anchor(batch, trajs)
    assert torch.equal(a.logp_anchor, b.logp_anchor) and a.metrics["ewma/n"] == b.metrics["ewma/n"] == 1.75
    assert all(torch.equal(strat._phi[k], resumed._phi[k]) for k in strat._phi)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_fold_goes_chunk_by_chunk_over_every_element(monkeypatch, dtype):
    # the fold works FOLD_CHUNK elements at a time (its fp32 temporaries stay small): every element is written,
    # the last, partial chunk too, and with the arithmetic of the whole tensor at once
    import recovery.ewma as ewma_mod

    monkeypatch.setattr(ewma_mod, "FOLD_CHUNK", 7)
    phi = torch.linspace(-2, 2, 50).reshape(5, 10).to(dtype)
    theta = torch.linspace(3, -1, 50).reshape(5, 10)
    out = torch.full((5, 10), float("nan"), dtype=dtype)
    gen = torch.Generator()
    gen.manual_seed(3)
    ewma_mod.fold_tensor(phi, theta, 0.25, 0.75, gen, out=out)
    exact = phi.float().mul(0.25).add(theta, alpha=0.75)  # the same ops over the whole tensor
    if dtype == torch.float32:
        assert torch.equal(out, exact)
    else:  # rounded stochastically: to one of the two bf16 values around the exact one
        ulp = torch.finfo(torch.bfloat16).eps * exact.abs()
        assert not out.isnan().any() and bool(((out.float() - exact).abs() <= ulp).all()), (out, exact)
