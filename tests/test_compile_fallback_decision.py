"""The compiled-call fallback decides by what failed: a planned call that fails in Chorus's kernels,
or while torch.compile traces or compiles the planned override (no frame of kernels/ on the
traceback then), runs again dense; another node's error propagates."""

import torch
import torch._dynamo.exc as dynamo_exc

from chorus_core.attention import sparse_patch
from chorus_core.attention.run_keys import sparse_plan_key, sparse_run_key


def raised(exc, cause=None):
    try:
        try:
            raise cause if cause is not None else exc
        except BaseException as inner:
            if cause is None:
                raise
            raise exc from inner
    except BaseException as caught:
        return caught


def test_compiler_errors_and_errors_raised_from_them_count_as_the_planned_path():
    assert sparse_patch.planned_path_failed(raised(dynamo_exc.Unsupported("graph break in the override")))
    assert sparse_patch.planned_path_failed(raised(RuntimeError("wrapped"), dynamo_exc.TorchRuntimeError("trace")))
    assert not sparse_patch.planned_path_failed(raised(ValueError("another node's block patch failed")))


class FakeRun:
    def __init__(self):
        self.failed, self.recorded = [], []

    def dense_under_multigpu(self, options):
        return False

    def plan_call(self, options, x, model):
        from chorus_core.attention.sparse_run import CallPlan

        return CallPlan(seq_len=4, masks=(None,), densities=(None,), sparse=torch.sin, dense=None)

    def observing(self):
        return False

    def fail_planned(self, layer, exc):
        self.failed.append(exc)

    def record_plan(self, plan):
        self.recorded.append(plan)


class FakeExecutor:
    """The model call: fails while the plan is in the options (as a traced override would)."""

    class_obj = object()

    def __init__(self, error):
        self.error, self.calls = error, []

    def __call__(self, x, t, transformer_options, **conds):  # a planned call also names its graph (graph_keys)
        options = transformer_options
        self.calls.append(sparse_plan_key("k") in options)
        if sparse_plan_key("k") in options:
            raise self.error
        return "dense output"


def test_a_planned_call_that_torch_compile_cannot_trace_runs_again_dense():
    wrapper = sparse_patch._make_apply_model_wrapper("k")
    run, executor = FakeRun(), FakeExecutor(dynamo_exc.Unsupported("the override graph-breaks under fullgraph"))
    options = {sparse_run_key("k"): run}

    assert wrapper(executor, torch.zeros(1), torch.zeros(1), transformer_options=options) == "dense output"
    assert executor.calls == [True, False] and len(run.failed) == 1 and run.recorded == []


def test_another_nodes_error_in_a_planned_call_propagates():
    wrapper = sparse_patch._make_apply_model_wrapper("k")
    run, executor = FakeRun(), FakeExecutor(ValueError("a block patch of another node failed"))
    try:
        wrapper(executor, torch.zeros(1), torch.zeros(1), transformer_options={sparse_run_key("k"): run})
    except ValueError:
        pass
    else:
        raise AssertionError("swallowed")
    assert executor.calls == [True] and run.failed == []
