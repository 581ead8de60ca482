"""The host engine's blockwise 8-bit AdamW against torchao's AdamW8bit update, run eagerly on the CPU.

torchao compiles its update with torch.compile; its eager form is the arithmetic the engine
matches. The moments (codes and scales) match it to the bit. The weights match it to the bit
with a correctly rounded square root in the reference; torch's vectorised CPU sqrt is not always
correctly rounded (as in test_host_adamw.py), so against torchao as it stands a weight can land
one ulp away."""
import pytest
import torch

from trainstream import _C

adam = pytest.importorskip("torchao.optim.adam")
subclass_8bit = pytest.importorskip("torchao.optim.subclass_8bit")


def _reference_step(p, g, m, v, step, lr, beta1, beta2, eps, wd, exact_sqrt=True):
    if exact_sqrt:  # torchao's update, with a square root rounded once from float64 (exact for fp32)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(torch.Tensor, "sqrt", lambda self: torch.sqrt(self.double()).float())
            return _reference_step(p, g, m, v, step, lr, beta1, beta2, eps, wd, exact_sqrt=False)
    adam.single_param_adam(p, g, torch.tensor(float(step)), m, v, None, torch.tensor(lr), beta1, beta2, wd, eps,
                           True, False)


def _engine_step(engine, p, g, m, v, step, lr, beta1, beta2, eps, wd, grad_scale=1.0):
    engine.step_8bit(p.data_ptr(), g.data_ptr(), "bfloat16" if g.dtype == torch.bfloat16 else "float32",
                     m.codes.data_ptr(), m.scale.data_ptr(), v.codes.data_ptr(), v.scale.data_ptr(),
                     m.qmap.data_ptr(), v.qmap.data_ptr(), p.numel(), lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                     weight_decay=wd, step=step, grad_scale=grad_scale)


def _state(numel):
    zeros = subclass_8bit.OptimState8bit.zeros
    return zeros((numel,), True, 256), zeros((numel,), False, 256)


@pytest.mark.parametrize("numel", [256, 4096, 3 * 65536 + 768])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_eight_bit_updates_match_torchao_bit_for_bit(numel, grad_dtype, isa):
    torch.manual_seed(0)
    engine = _C.HostAdamW(threads=2, isa=isa)
    p_ref = torch.randn(numel)
    p_ours = p_ref.clone()
    (m_ref, v_ref), (m_ours, v_ours) = _state(numel), _state(numel)
    hyper = dict(lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8, wd=0.1)
    for step in range(1, 6):
        g = (torch.randn(numel) * 10.0 ** (step - 3)).to(grad_dtype)
        p_before = p_ref.clone()
        m_before = [subclass_8bit.OptimState8bit(s.codes.clone(), s.scale.clone(), s.qmap, s.signed)
                    for s in (m_ref, v_ref)]
        _reference_step(p_ref, g, m_ref, v_ref, step, **hyper)
        _engine_step(engine, p_ours, g, m_ours, v_ours, step, **hyper)
        assert torch.equal(p_ours, p_ref), f"weights differ at step {step}"
        p_torchao = p_before.clone()
        _reference_step(p_torchao, g, m_before[0], m_before[1], step, **hyper, exact_sqrt=False)
        ulp = (torch.nextafter(p_ref.abs(), torch.tensor(float("inf"))) - p_ref.abs()).clamp(min=3e-7)
        assert ((p_torchao - p_ref).abs() <= ulp).all(), "beyond max(3e-7, 1 ulp) of torchao's own sqrt"
        for ours, ref in ((m_ours, m_ref), (v_ours, v_ref)):
            assert torch.equal(ours.codes, ref.codes) and torch.equal(ours.scale, ref.scale), f"state at step {step}"


def test_a_gradient_scale_is_the_clip_coefficient_applied_first(isa):
    torch.manual_seed(1)
    numel, coef = 8192, 0.37
    engine = _C.HostAdamW(threads=2, isa=isa)
    g = torch.randn(numel)
    p_ref = torch.randn(numel)
    p_ours = p_ref.clone()
    (m_ref, v_ref), (m_ours, v_ours) = _state(numel), _state(numel)
    hyper = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.01)
    _reference_step(p_ref, g * coef, m_ref, v_ref, 1, **hyper)
    _engine_step(engine, p_ours, g, m_ours, v_ours, 1, **hyper, grad_scale=coef)
    assert torch.equal(p_ours, p_ref)
    assert torch.equal(m_ours.codes, m_ref.codes)


def _edges(qmap: torch.Tensor) -> torch.Tensor:
    """Every value of a map, the midpoints between neighbours and the floats either side of
    each: where a quantizer that is off by one code shows it."""
    inf = torch.tensor(float("inf"))
    mids = (qmap[:-1] + qmap[1:]) / 2
    points = torch.cat([qmap, mids])
    return torch.cat([points, torch.nextafter(points, inf), torch.nextafter(points, -inf),
                      torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-9, 3e-38])]).clamp(-1, 1)


def test_every_kernel_quantizes_at_the_edges_of_the_map_as_torchao_does(isa):
    """With beta1 = beta2 = 0 the new moments are the gradient and its square, so a gradient made
    of the map's values, midpoints and their neighbours (with 1.0 in each block, its scale)
    quantizes exactly those values; zero and non-finite blocks beside them."""
    m, v = _state(256)
    values = _edges(m.qmap)
    numel = (values.numel() // 255 + 1) * 256
    g = torch.zeros(numel)
    body = g.view(-1, 256)
    body[:, 0] = 1.0
    flat = body[:, 1:].reshape(-1)
    flat[:values.numel()] = values
    body[:, 1:] = flat.view(-1, 255)
    g = torch.cat([g, torch.zeros(256), torch.full((256,), 1e-20)])  # a zero block, a tiny one
    p_ref = torch.randn(g.numel())
    p_ours = p_ref.clone()
    (m_ref, v_ref), (m_ours, v_ours) = _state(g.numel()), _state(g.numel())
    hyper = dict(lr=1e-3, beta1=0.0, beta2=0.0, eps=1e-8, wd=0.0)
    _reference_step(p_ref, g, m_ref, v_ref, 1, **hyper)
    _engine_step(_C.HostAdamW(threads=2, isa=isa), p_ours, g, m_ours, v_ours, 1, **hyper)
    for ours, ref in ((m_ours, m_ref), (v_ours, v_ref)):
        assert torch.equal(ours.scale, ref.scale)
        assert torch.equal(ours.codes, ref.codes), (ours.codes != ref.codes).nonzero()[:5]
    assert torch.equal(p_ours, p_ref)


def test_non_finite_gradients_quantize_as_the_scalar_kernel_does(isa):
    torch.manual_seed(2)
    g = torch.randn(1024)
    g[3], g[300], g[600], g[601] = float("nan"), float("inf"), float("-inf"), float("nan")
    runs = []
    for kernel in ("scalar", isa):
        p = torch.ones(1024)
        m, v = _state(1024)
        _engine_step(_C.HostAdamW(threads=1, isa=kernel), p, g, m, v, 1, lr=1e-3, beta1=0.9, beta2=0.99,
                     eps=1e-8, wd=0.0)
        runs.append((p, m.codes, m.scale, v.codes, v.scale))
    for a, b in zip(*runs):
        assert torch.equal(a, b) or torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())


def test_sizes_that_are_not_whole_blocks_are_refused():
    engine = _C.HostAdamW(threads=1)
    p = torch.zeros(300)
    m, v = _state(512)
    with pytest.raises(ValueError, match="multiple of 256"):
        _engine_step(engine, p, p, m, v, 1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, wd=0.0)


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_the_offload_pipeline_runs_torchaos_update_on_8bit_moments(isa, weight_dtype):
    """Gradients landed and updated by the pipeline's threads, chunk by chunk, against torchao's
    update over an fp32 master (bf16 weights: the master rounded to nearest, as they go up)."""
    torch.manual_seed(3)
    numel = 3 * 4096 + 512
    pipeline = _C.host_pipeline(3, isa)
    m_ref, v_ref = _state(numel)
    pipeline.set_quantization_maps(m_ref.qmap.data_ptr(), v_ref.qmap.data_ptr())
    host = pipeline.add_param(numel, "bfloat16" if weight_dtype == torch.bfloat16 else "float32", False,
                              moments="8bit")
    assert host.moments == "8bit" and host.state_bytes == _C.OffloadPipeline.state_bytes(
        numel, "bfloat16" if weight_dtype == torch.bfloat16 else "float32", False, moments="8bit")
    device = torch.randn(numel).to(weight_dtype)
    master = device.float().clone()  # (.float() of fp32 weights is the same tensor)
    pipeline.load_weights(host, device.data_ptr())
    hyper = dict(lr=2e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    for step in range(1, 4):
        grad = (torch.randn(numel) * 10.0 ** (step - 2)).to(weight_dtype)
        pipeline.land_gradient(host, grad.data_ptr(), 0)
        pipeline.submit(host, update=True, device_weight=device.data_ptr(), step=step, **hyper)
        pipeline.synchronize()
        _reference_step(master, grad.float(), m_ref, v_ref, step, hyper["lr"], hyper["beta1"], hyper["beta2"],
                        hyper["eps"], hyper["weight_decay"])
    view = lambda name, dtype: torch.frombuffer(host.view(name), dtype=dtype)  # noqa: E731
    assert torch.equal(view("master", torch.float32), master)
    assert torch.equal(view("exp_avg_codes", torch.uint8), m_ref.codes)
    assert torch.equal(view("exp_avg_sq_scale", torch.float32), v_ref.scale)
    assert torch.equal(device, master.to(weight_dtype))
    with pytest.raises(ValueError, match="no buffer 'exp_avg'"):
        host.view("exp_avg")
