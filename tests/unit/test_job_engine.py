"""Jobs (loading, building, fingerprints, flat models) and the worker's gradient engine, checked
against gradients computed the plain way."""

from __future__ import annotations

import dataclasses
import sys
import threading

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from idlegrad.common import builtin_jobs, job_loading
from idlegrad.common.errors import JobError
from idlegrad.common.job import FlatModel, Job, build, coded_gradient, evaluate, gather
from idlegrad.common.job_loading import builtin_job_names, load_job, parse_job_args, resolve_factory
from idlegrad.common.permutation import part_indices
from idlegrad.worker.engine import Cancelled, Engine, Work

SEED = 3


@pytest.fixture(scope="module")
def digits_built():
    return build(load_job("digits", {"hidden": 16}), seed=0)


def one_line(exc: BaseException) -> str:
    text = str(exc)
    assert text and "\n" not in text
    return text


# loading ---------------------------------------------------------------------------------------


def test_builtin_names():
    assert builtin_job_names() == ["digits", "lm", "packed", "resnet", "synthetic"]
    for name in builtin_job_names():  # each is its factory's name in builtin_jobs
        assert resolve_factory(name) is getattr(builtin_jobs, name)


def test_common_job_is_the_public_face_of_jobs():
    """Job files import `idlegrad.common.job.Job`, and the coordinator takes the loading
    functions from there too: they stay importable from it."""
    from idlegrad.common import job, job_definition

    assert job.Job is job_definition.Job
    for name in ("builtin_job_names", "load_job", "parse_job_args", "resolve_factory"):
        assert getattr(job, name) is getattr(job_loading, name)


def test_load_builtin_digits():
    job = load_job("digits")
    assert isinstance(job, Job) and job.name == "digits" and job.batch_size == 32
    job = load_job("digits", {"batch_size": 8, "hidden": 4})
    assert job.batch_size == 8


def test_load_builtin_synthetic_with_args():
    job = load_job("synthetic", {"params": 5000, "samples": 200})
    built = build(job)
    assert abs(built.model.numel - 5000) < 200
    assert len(built.train) + len(built.test) == 200
    assert len(built.test) == 20


def test_load_module_attr():
    job = load_job("idlegrad.common.builtin_jobs:synthetic", {"params": 100, "samples": 10})
    assert job.name == "synthetic"
    assert resolve_factory("idlegrad.common.builtin_jobs:digits") is builtin_jobs.digits


JOB_FILE = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset
from idlegrad.common.job import Job

def make_job(width=3, batch_size=4):
    def data():
        x = torch.arange(24, dtype=torch.float32).reshape(12, 2)
        y = (x.sum(1) > 10).long()
        return TensorDataset(x[:8], y[:8]), TensorDataset(x[8:], y[8:])
    return Job(name="tiny", build_model=lambda: nn.Linear(2, width), build_datasets=data,
               loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
               build_optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=batch_size)

NOT_CALLABLE = 3

def boom():
    raise RuntimeError("kaput")

def raises_type_error_inside():
    return None + 1

def wrong_type():
    return {"name": "not a job"}

def zero_batch():
    return make_job(batch_size=0)

def job_error():
    from idlegrad.common.errors import JobError
    raise JobError("this job needs a GPU")
'''


@pytest.fixture
def job_file(tmp_path):
    path = tmp_path / "myjobs.py"
    path.write_text(JOB_FILE)
    return str(path)


def test_load_file_attr(job_file):
    job = load_job(f"{job_file}:make_job", {"width": 2})
    assert job.name == "tiny"
    built = build(job)
    assert built.model.numel == 2 * 2 + 2 and len(built.train) == 8


def test_load_module_from_path(tmp_path, monkeypatch):
    (tmp_path / "ig_test_jobs_mod.py").write_text(JOB_FILE)
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        assert load_job("ig_test_jobs_mod:make_job").name == "tiny"
    finally:
        sys.modules.pop("ig_test_jobs_mod", None)


def test_file_that_fails_to_import(tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("raise ValueError('no\\nway')\n")
    with pytest.raises(JobError) as e:
        load_job(f"{path}:x")
    assert "failed to import" in str(e.value)
    # a broken module is not left behind in sys.modules
    assert not [m for m in sys.modules if m.startswith("idlegrad_job_") and
                getattr(sys.modules[m], "__file__", None) == str(path)]


def test_module_that_fails_to_import(tmp_path, monkeypatch):
    (tmp_path / "ig_test_broken_mod.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(JobError) as e:
        load_job("ig_test_broken_mod:x")
    assert "RuntimeError" in one_line(e.value)


@pytest.mark.parametrize("spec,args,needle", [
    ("nosuchjob", None, "unknown job"),
    ("Digits", None, "unknown job"),
    ("", None, "unknown job"),
    (":make_job", None, "must look like"),
    ("idlegrad.common.builtin_jobs:", None, "must look like"),
    ("no_such_module_ig:make_job", None, "cannot import"),
    ("idlegrad.common.builtin_jobs:nothing", None, "no attribute"),
    ("idlegrad.common.job_loading:BUILTIN_JOBS", None, "not callable"),
    ("digits", {"nonsense": 1}, "does not take"),
    ("synthetic", {"params": 0}, "synthetic"),  # the factory's own JobError goes through
])
def test_load_errors(spec, args, needle):
    with pytest.raises(JobError) as e:
        load_job(spec, args)
    assert needle in one_line(e.value)


@pytest.mark.parametrize("attr,needle", [
    ("nothere", "no attribute"),
    ("NOT_CALLABLE", "not callable"),
    ("boom", "failed to build"),
    ("wrong_type", "not idlegrad.common.job.Job"),
    ("zero_batch", "batch_size"),
    ("job_error", "needs a GPU"),
])
def test_file_load_errors(job_file, attr, needle):
    with pytest.raises(JobError) as e:
        load_job(f"{job_file}:{attr}")
    assert needle in one_line(e.value)
    if attr == "boom":
        assert "RuntimeError" in str(e.value) and "kaput" in str(e.value)


def test_bad_kwargs_for_a_file_job(job_file):
    with pytest.raises(JobError) as e:
        load_job(f"{job_file}:make_job", {"depth": 3})
    assert "depth" in one_line(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(JobError) as e:
        load_job(f"{tmp_path / 'nope.py'}:x")
    assert "does not exist" in one_line(e.value)
    with pytest.raises(JobError):
        load_job("nope.py:x")


def test_parse_job_args():
    args = parse_job_args(["params=5000", "lr=0.05", "flag=true", "off=False", "name=mnist",
                           "big=1e3", "neg=-2", "empty=", "nan=nan", "inf=inf", "eq=a=b"])
    assert args == {"params": 5000, "lr": 0.05, "flag": True, "off": False, "name": "mnist",
                    "big": 1000.0, "neg": -2, "empty": "", "nan": "nan", "inf": "inf", "eq": "a=b"}
    assert type(args["params"]) is int and type(args["lr"]) is float
    assert type(args["flag"]) is bool and type(args["big"]) is float
    assert parse_job_args([]) == {}
    assert parse_job_args(["a=1", "a=2"]) == {"a": 2}


@pytest.mark.parametrize("item", ["noequals", "=3", "1x=2", "a-b=1", "a b=1"])
def test_parse_job_args_errors(item):
    with pytest.raises(JobError) as e:
        parse_job_args([item])
    one_line(e.value)


# building ---------------------------------------------------------------------------------------


def test_fingerprint_stable_and_sensitive(job_file):
    a = build(load_job(f"{job_file}:make_job"))
    b = build(load_job(f"{job_file}:make_job"))
    assert a.fingerprint == b.fingerprint
    assert len(a.fingerprint) == 16 and int(a.fingerprint, 16) >= 0
    assert torch.equal(a.model.params, b.model.params)  # the same seed builds the same model
    c = build(load_job(f"{job_file}:make_job", {"width": 4}))
    assert c.fingerprint != a.fingerprint
    d = build(load_job(f"{job_file}:make_job"), seed=1)
    assert d.fingerprint == a.fingerprint and not torch.equal(d.model.params, a.model.params)


def test_fingerprint_of_digits(digits_built):
    again = build(load_job("digits", {"hidden": 16}), seed=0)
    assert again.fingerprint == digits_built.fingerprint
    assert build(load_job("digits", {"hidden": 8})).fingerprint != digits_built.fingerprint


def test_build_does_not_disturb_the_global_rng(job_file):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build(load_job(f"{job_file}:make_job"))
    assert torch.equal(torch.rand(3), expected)


def _job(**kw):
    base = dict(name="t", build_model=lambda: nn.Linear(2, 2),
                build_datasets=lambda: (TensorDataset(torch.zeros(4, 2)), TensorDataset(torch.zeros(1, 2))),
                loss=lambda m, b: m(b[0]).sum(), build_optimizer=lambda p: torch.optim.SGD(p, lr=1),
                batch_size=2)
    base.update(kw)
    return Job(**base)


@pytest.mark.parametrize("kw,needle", [
    (dict(build_model=lambda: 5), "nn.Module"),
    (dict(build_model=lambda: nn.ReLU()), "no parameters"),
    (dict(build_model=lambda: nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double())), "dtype"),
    (dict(build_datasets=lambda: TensorDataset(torch.zeros(4, 2))), "(train, test)"),
    (dict(build_datasets=lambda: (TensorDataset(torch.zeros(0, 2)), TensorDataset(torch.zeros(1, 2)))), "empty"),
    (dict(build_datasets=lambda: ([1, 2], iter([]))), "map-style"),
    (dict(build_datasets=lambda: 1 / 0), "ZeroDivisionError"),
])
def test_build_errors(kw, needle):
    with pytest.raises(JobError) as e:
        build(_job(**kw))
    assert needle in one_line(e.value)


def test_flat_model_views():
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    original = [p.detach().clone() for p in module.parameters()]
    flat = FlatModel(module)
    assert flat.numel == 3 * 4 + 4 + 4 * 2 + 2
    # the values survive the move into the flat vector, in parameters() order
    assert torch.equal(flat.params, torch.cat([p.reshape(-1) for p in original]))
    assert flat.layout() == [["0.weight", [4, 3], "float32"], ["0.bias", [4], "float32"],
                             ["2.weight", [2, 4], "float32"], ["2.bias", [2], "float32"]]
    # changing the flat vector changes the module
    with torch.no_grad():
        flat.params[0] = 42.0
        flat.params[-1] = -7.0
    assert module[0].weight[0, 0].item() == 42.0
    assert module[2].bias[-1].item() == -7.0
    # and the other way round
    with torch.no_grad():
        module[0].bias.fill_(3.0)
    assert torch.equal(flat.params[12:16], torch.full((4,), 3.0))
    # load copies a whole model in
    new = torch.arange(flat.numel, dtype=torch.float32)
    flat.load(new)
    assert torch.equal(module[2].weight.detach().reshape(-1), new[16:24])
    new[0] = 999.0
    assert flat.params[0] == 0.0  # a copy, not an alias of the argument
    # gradients land in the flat grads vector
    flat.grads.zero_()
    module(torch.ones(5, 3)).sum().backward()
    assert torch.equal(flat.grads[16 + 8:], torch.full((2,), 5.0))  # d/d bias2 of the sum
    assert module[2].bias.grad.data_ptr() == flat.grads[24:].data_ptr()
    assert torch.count_nonzero(flat.grads) > 2


# the engine --------------------------------------------------------------------------------------


def reference_gradient(built, params, parts, coefficients, seed=SEED):
    """sum_j c_j * gradient of the summed per-sample loss of part j, the plain way."""
    module = built.job.build_model()
    torch.nn.utils.vector_to_parameters(params, module.parameters())
    module.train()
    n = len(built.train)
    total = torch.zeros_like(params, dtype=torch.float64)
    loss_sum, count = 0.0, 0
    for (epoch, offset, c), coef in zip(parts, coefficients):
        idx = part_indices(seed, n, epoch, offset, c)
        x, y = gather(built.train, idx)
        loss = nn.functional.cross_entropy(module(x), y, reduction="sum")
        grads = torch.autograd.grad(loss, list(module.parameters()))
        total += coef * torch.cat([g.reshape(-1) for g in grads]).double()
        loss_sum += float(loss.detach())
        count += c
    return total.float(), loss_sum / count


def make_engine(built):
    return Engine(built, seed=SEED, device=torch.device("cpu"))


def fixed_micro_batch_engine(built, micro_batch: int, monkeypatch, loss=None):
    """An engine that computes in micro-batches of `micro_batch` samples (its adaptation to the
    measured speed is off), with `loss` in place of the job's own where given."""
    if loss is not None:
        built = dataclasses.replace(built, job=dataclasses.replace(built.job, loss=loss))
    engine = make_engine(built)
    engine.micro_batch = micro_batch
    monkeypatch.setattr(engine, "_observe", lambda *a: None)
    return engine


def random_params(built, seed):
    g = torch.Generator().manual_seed(seed)
    return 0.3 * torch.randn(built.model.numel, generator=g)


@pytest.mark.parametrize("parts,coefficients", [
    ([[0, 0, 40]], [1.0]),
    ([[0, 100, 37]], [2.5]),
    ([[0, 0, 20], [1, 5, 30]], [0.5, -2.0]),
    ([[2, 1400, 38], [0, 0, 3]], [1.0, 0.0]),
])
def test_engine_gradient_equals_reference(digits_built, parts, coefficients):
    engine = make_engine(digits_built)
    params = random_params(digits_built, 1)
    out = engine.compute(Work(slot=7, version=4, params=params, parts=parts,
                              coefficients=coefficients), threading.Event())
    expected, loss = reference_gradient(digits_built, params, parts, coefficients)
    assert out.slot == 7 and out.version == 4
    assert out.samples == sum(p[2] for p in parts)
    assert out.gradient.shape == params.shape and out.gradient.device.type == "cpu"
    assert torch.allclose(out.gradient, expected, atol=1e-5, rtol=1e-5)
    assert out.loss == pytest.approx(loss, rel=1e-5)
    assert out.compute_s > 0
    assert torch.count_nonzero(out.gradient) > 0 or all(c == 0 for c in coefficients)


def test_engine_result_is_owned_and_repeatable(digits_built):
    engine = make_engine(digits_built)
    params = random_params(digits_built, 2)
    work = Work(slot=1, version=0, params=params, parts=[[0, 0, 16]], coefficients=[1.0])
    first = engine.compute(work, threading.Event())
    second = engine.compute(work, threading.Event())  # the gradient buffer is reset between
    assert torch.allclose(first.gradient, second.gradient, atol=1e-6)
    assert first.gradient.data_ptr() != digits_built.model.grads.data_ptr()
    other = engine.compute(Work(2, 0, params, [[0, 16, 16]], [1.0]), threading.Event())
    assert torch.allclose(first.gradient, second.gradient, atol=1e-6)  # not overwritten
    assert not torch.allclose(first.gradient, other.gradient)


def test_micro_batching_gives_the_same_gradient(digits_built, monkeypatch):
    parts, coefficients = [[0, 3, 50], [1, 0, 11]], [1.0, 3.0]
    params = random_params(digits_built, 3)
    whole = fixed_micro_batch_engine(digits_built, 4096, monkeypatch)
    big = whole.compute(Work(1, 0, params, parts, coefficients), threading.Event())

    calls = []
    loss = digits_built.job.loss

    def counting_loss(model, batch):
        calls.append(len(batch[1]))
        return loss(model, batch)

    small = fixed_micro_batch_engine(digits_built, 3, monkeypatch, loss=counting_loss)
    out = small.compute(Work(1, 0, params, parts, coefficients), threading.Event())
    assert calls == [3] * 16 + [2] + [3] * 3 + [2]  # really in micro-batches of 3
    assert torch.allclose(out.gradient, big.gradient, atol=1e-5, rtol=1e-5)
    assert out.loss == pytest.approx(big.loss, rel=1e-5)
    expected, _ = reference_gradient(digits_built, params, parts, coefficients)
    assert torch.allclose(out.gradient, expected, atol=1e-5, rtol=1e-5)


def test_micro_batch_adapts_to_speed(digits_built):
    engine = make_engine(digits_built)
    engine._observe(100, 0.1)  # 1 ms per sample: 0.2 s is 200 samples
    assert engine.micro_batch == 200
    engine._observe(0, 1.0)  # ignored
    engine._observe(10, 0.0)
    assert engine.micro_batch == 200
    for _ in range(50):
        engine._observe(1000, 1e-6)
    assert engine.micro_batch == 4096
    for _ in range(50):
        engine._observe(1, 10.0)
    assert engine.micro_batch == 1


def test_cancel_before_start(digits_built):
    engine = make_engine(digits_built)
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(Cancelled):
        engine.compute(Work(1, 0, random_params(digits_built, 4), [[0, 0, 32]], [1.0]), cancel)


def test_cancel_between_micro_batches(digits_built, monkeypatch):
    cancel = threading.Event()
    calls = []
    loss = digits_built.job.loss

    def cancelling_loss(model, batch):
        calls.append(1)
        if len(calls) == 2:
            cancel.set()
        return loss(model, batch)

    engine = fixed_micro_batch_engine(digits_built, 4, monkeypatch, loss=cancelling_loss)
    with pytest.raises(Cancelled):
        engine.compute(Work(1, 0, random_params(digits_built, 5), [[0, 0, 40]], [1.0]), cancel)
    assert len(calls) == 2  # stopped at the next micro-batch, not at the end


def test_engine_check(digits_built):
    engine = make_engine(digits_built)
    n = len(digits_built.train)
    engine.check(Work(1, 0, torch.zeros(1), [[0, 0, n], [5, n - 1, 1]], [1.0, 1.0]))
    with pytest.raises(ValueError):
        engine.check(Work(1, 0, torch.zeros(1), [[0, n - 1, 2]], [1.0]))
    with pytest.raises(ValueError):
        engine.check(Work(1, 0, torch.zeros(1), [[0, 0, 1], [0, -1, 1]], [1.0, 1.0]))


# evaluation ---------------------------------------------------------------------------------------


def test_default_evaluate_digits(digits_built):
    module = digits_built.model.module
    module.train()
    metrics = evaluate(digits_built.job, module, digits_built.test, chunk=100)
    assert set(metrics) == {"loss", "accuracy"}
    assert module.training  # the mode is restored
    x, y = digits_built.test.tensors
    with torch.no_grad():
        logits = module(x)
    assert metrics["loss"] == pytest.approx(float(nn.functional.cross_entropy(logits, y)), rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(float((logits.argmax(1) == y).float().mean()))
    assert 0.0 <= metrics["accuracy"] <= 1.0
    # chunking does not change the answer
    again = evaluate(digits_built.job, module, digits_built.test, chunk=7)
    assert again["loss"] == pytest.approx(metrics["loss"], rel=1e-5)
    assert again["accuracy"] == metrics["accuracy"]


def test_evaluate_regression_has_no_accuracy():
    job = _job(loss=lambda m, b: nn.functional.mse_loss(m(b[0]), b[1]))
    module = nn.Linear(2, 1)
    with torch.no_grad():
        module.weight.fill_(1.0)
        module.bias.fill_(0.0)
    x = torch.tensor([[1.0, 1.0], [2.0, 0.0]])
    y = torch.tensor([[0.0], [0.0]])
    metrics = evaluate(job, module, TensorDataset(x, y))
    assert metrics == {"loss": pytest.approx(4.0)}
    module.eval()
    evaluate(job, module, TensorDataset(x, y))
    assert not module.training


def test_evaluate_uses_the_job_evaluate():
    job = _job(evaluate=lambda m, ds: {"custom": len(ds), 5: 1})
    assert evaluate(job, nn.Linear(2, 2), TensorDataset(torch.zeros(3, 2))) == {"custom": 3.0,
                                                                                "5": 1.0}
    assert evaluate(_job(), nn.Linear(2, 2), TensorDataset(torch.zeros(0, 2))) == {}


def test_type_error_inside_a_factory_is_a_job_error(job_file):
    # reported as "does not take these arguments", which is misleading but still one JobError
    with pytest.raises(JobError) as e:
        load_job(f"{job_file}:raises_type_error_inside")
    one_line(e.value)


def test_flat_model_loads_chunks_and_swaps_gradient_buffers(digits_built):
    flat = digits_built.model
    target = torch.randn(flat.numel)
    flat.load([target[:100], target[100:101], target[101:]])
    assert torch.equal(flat.params, target)
    with pytest.raises(ValueError):
        flat.load([target[:5]])
    buffer = torch.full((flat.numel,), 7.0)
    flat.use_grads(buffer)
    first = next(flat.module.parameters())
    assert first.grad.data_ptr() == buffer.data_ptr() and flat.grads is buffer
    with pytest.raises(ValueError):
        flat.use_grads(torch.zeros(3))


def test_engine_gradients_stay_valid_until_released_then_are_reused(digits_built):
    engine = Engine(digits_built, seed=0, device=torch.device("cpu"))
    params = random_params(digits_built, 3)
    one = engine.compute(Work(1, 0, params, [[0, 0, 16]], [1.0]), threading.Event())
    kept = one.gradient.clone()
    two = engine.compute(Work(2, 0, params, [[0, 16, 16]], [1.0]), threading.Event())
    assert two.gradient.data_ptr() != one.gradient.data_ptr()
    assert torch.equal(one.gradient, kept)  # not overwritten by the next slot
    engine.release(one.gradient)  # no tracker: free at once
    three = engine.compute(Work(3, 0, params, [[0, 0, 16]], [1.0]), threading.Event())
    assert three.gradient.data_ptr() == one.gradient.data_ptr()
    assert torch.allclose(three.gradient, kept)  # same slot, same model: same gradient
    # the model is loaded once per params object: a chunked copy of other values reloads it
    chunks = [torch.zeros(10), torch.zeros(digits_built.model.numel - 10)]
    engine.compute(Work(4, 1, chunks, [[0, 0, 4]], [1.0]), threading.Event())
    assert float(digits_built.model.params.abs().sum()) == 0.0


@pytest.mark.parametrize("micro_batch", [5, 64])  # micro-batches split the parts, or hold them
def test_the_coordinators_coded_gradient_is_the_workers_bit_for_bit(digits_built, micro_batch,
                                                                     monkeypatch):
    """The coordinator judges a worker's slot by computing it itself (common.job.coded_gradient):
    with the worker's micro-batches, an honest worker's gradient is the same, to the bit."""
    parts, coefficients = [[0, 0, 40], [0, 40, 7], [1, 5, 9], [2, 3, 0]], [1.0, -0.5, 2.0, 3.0]
    params = random_params(digits_built, 6)
    engine = fixed_micro_batch_engine(digits_built, micro_batch, monkeypatch)
    engine.compute(Work(1, 0, random_params(digits_built, 7), [[0, 0, 9]], [1.0]),
                   threading.Event())  # a slot before, at another model, in another buffer
    worker = engine.compute(Work(2, 0, params, parts, coefficients), threading.Event())
    scratch = FlatModel(digits_built.job.build_model())
    coded_gradient(digits_built.job, scratch, random_params(digits_built, 8), digits_built.train,
                   SEED, [[1, 0, 11]], [2.0], micro_batch)  # the judge's scratch model, used
    judged = coded_gradient(digits_built.job, scratch, params, digits_built.train, SEED, parts,
                            coefficients, micro_batch)
    assert torch.equal(judged, worker.gradient)
    assert torch.count_nonzero(judged) > 0


SUMMED_JOB = '''
import torch
from torch import nn
from torch.utils.data import TensorDataset
from idlegrad.common.job import Job


def make(reduction: str = "sum"):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(200, 8, generator=g), torch.randint(0, 3, (200,), generator=g)
    return Job(name="summed", build_model=lambda: nn.Linear(8, 3),
               build_datasets=lambda: (TensorDataset(x[:160], y[:160]), TensorDataset(x[160:], y[160:])),
               loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1], reduction=reduction),
               build_optimizer=lambda p: torch.optim.SGD(p, lr=0.1), batch_size=32)
'''


def test_a_loss_that_sums_over_the_batch_is_said_at_build_and_a_mean_is_not(tmp_path):
    from idlegrad.coordinator.config import CoordinatorConfig, check
    from idlegrad.coordinator.training import Training

    path = tmp_path / "summed.py"
    path.write_text(SUMMED_JOB)

    def warning(**args):
        config = CoordinatorConfig(job=f"{path}:make", job_args=args)
        return Training(config, check(config)).loss_warning

    said = warning()
    assert said is not None and "sum over the batch" in said and "32" in said, said
    assert warning(reduction="mean") is None
    config = CoordinatorConfig(job="digits")
    assert Training(config, check(config)).loss_warning is None


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("micro", [1, 31, 16])
def test_a_batchnorm_job_computes_whatever_micro_batch_the_worker_picks(micro, dropout):
    """The walkthrough of issue 29: a worker's speed-sized micro-batch came down to 1 on a busy
    machine (or a 32-sample part was cut 31 + 1), BatchNorm refused the single sample, and every
    slot after failed. No micro-batch holds one sample unless its whole part does."""
    from idlegrad.common.job import accumulate_coded_gradient

    def datasets():
        g = torch.Generator().manual_seed(0)
        x = torch.randn(200, 6, generator=g)
        y = (x[:, 0] > 0).long()
        return TensorDataset(x[:160], y[:160]), TensorDataset(x[160:], y[160:])

    job = Job(name="bn", build_model=lambda: nn.Sequential(
        nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Dropout(dropout), nn.Linear(8, 2)),
        build_datasets=datasets,
        loss=lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1]),
        build_optimizer=lambda params: torch.optim.SGD(params, lr=0.1), batch_size=32)
    built = build(job)
    sizes = []
    for part in ([0, 0, 32], [0, 63, 67]):  # the second starts one sample before a block's end
        built.model.grads.zero_()
        accumulate_coded_gradient(job, built.model, built.train, 0, [part], [1.0],
                                  micro_batch=lambda: micro, observe=sizes.append,
                                  block=built.random_block)
        assert torch.isfinite(built.model.grads).all() and built.model.grads.abs().sum() > 0
    assert min(sizes) >= 2, sizes


def test_a_warmed_up_engine_has_measured_its_speed_and_computes_the_same_gradients():
    """The worker warms its engine up when it builds the job (a first forward and backward pay
    torch's set-up, which a first task paid at its slowdown's multiple): the warm-up sizes the
    micro-batches, leaves the model as built, and changes no task's gradient."""
    import threading

    from idlegrad.common.builtin_jobs import digits
    from idlegrad.common.job import build
    from idlegrad.worker.engine import Engine, Work

    built = build(digits())
    cold = Engine(built, seed=3, device=torch.device("cpu"))
    warm = Engine(built, seed=3, device=torch.device("cpu"))
    before = built.model.params.clone()
    warm.warm_up()
    assert warm._s_per_sample is not None and cold._s_per_sample is None
    assert warm.micro_batch != 16  # sized from the warm-up's micro-batches
    assert torch.equal(built.model.params, before)
    for engine in (warm, cold):  # the same micro-batches: the same sums
        engine.micro_batch = 8
        engine._observe = lambda *a: None
    params = 0.2 * torch.randn(built.model.numel, generator=torch.Generator().manual_seed(0))
    work = Work(1, 0, params, [[0, 5, 40]], [1.0])
    a = cold.compute(work, threading.Event())
    cold_gradient = a.gradient.clone()
    b = warm.compute(work, threading.Event())
    assert torch.equal(b.gradient, cold_gradient) and b.samples == a.samples == 40
