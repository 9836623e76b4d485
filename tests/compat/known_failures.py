"""Public-set failures grouped by cause, from reading them (REPORT.md's groups).

``label -> (description, keys)``; keys are ``"<torch suite>.<test>"``.  The
report places each failing test under the first group listing it; failures
listed nowhere are grouped by error line.  A test listed here that passes is
flagged in the report: take it out.  Descriptions say what was observed, and
the probable cause where the failure was read far enough to say.
"""

from __future__ import annotations

__all__ = ["KNOWN_FAILURES"]

KNOWN_FAILURES: dict[str, tuple[str, tuple[str, ...]]] = {
    "@async_execution through RRef proxies": (
        "`rref.rpc_sync().method(...)` (and `rpc_async()`, `remote()`) on a method decorated "
        "with `@rpc.functions.async_execution` (static, class or instance method) returns "
        "the Future itself instead of waiting for it: \"cannot pickle the result of the "
        "function on workerN: RuntimeError: Can not pickle torch.futures.Future\". The "
        "parameter-server example (`test_my_parameter_server*`) uses this.",
        (
            "RpcTest.test_async_class_rref_proxy",
            "RpcTest.test_async_class_rref_proxy_async",
            "RpcTest.test_async_class_rref_proxy_remote",
            "RpcTest.test_my_parameter_server",
            "TensorPipeAgentRpcTest.test_my_parameter_server_sparse",
        ),
    ),
    "@async_execution function that returns no Future": (
        "torch raises RuntimeError \"Functions decorated with @rpc.async_function must "
        "return a torch.futures.Future object, ...\" on the caller. ucxrpc raises TypeError "
        "(\"@async_execution function async_wrong_type returned Tensor, not a "
        "torch.futures.Future\") for rpc_sync / rpc_async, and for `remote()` raises "
        "nothing: `to_here()` returns the Tensor.",
        (
            "RpcTest.test_async_function_wrong_return_type",
            "RpcTest.test_async_function_wrong_return_type_async",
            "RpcTest.test_async_function_wrong_return_type_remote",
        ),
    ),
    "Sparse tensors in distributed autograd": (
        "Sparse tensors that need grad come out of RPCs without autograd history (the "
        "backward pass finds no grad_fn: \"element 0 of tensors does not require grad\"), "
        "and "
        "sparse gradients cannot be stored in the context "
        "(`ucxrpc/autograd/_engine.py` `_owned` calls `untyped_storage()`: \"Cannot access "
        "storage of SparseTensorImpl\"). `test_trainer_ps_sparse` hangs: its trainers fail "
        "this way and the test polls forever for them (torch's test has no deadline), so "
        "it ends at the runner's timeout.",
        (
            "TensorPipeAgentDistAutogradTest.test_backward_different_dtypes_sparse",
            "TensorPipeAgentDistAutogradTest.test_backward_multiple_round_trips_sparse",
            "TensorPipeAgentDistAutogradTest.test_backward_no_grad_on_tensor_sparse",
            "TensorPipeAgentDistAutogradTest.test_backward_rref_multi_sparse",
            "TensorPipeAgentDistAutogradTest.test_backward_rref_nested_sparse",
            "TensorPipeAgentDistAutogradTest.test_backward_rref_sparse",
            "TensorPipeAgentDistAutogradTest.test_backward_simple_python_udf_sparse",
            "TensorPipeAgentDistAutogradTest.test_backward_simple_self_sparse",
            "TensorPipeAgentDistAutogradTest.test_backward_simple_sparse",
            "TensorPipeAgentDistAutogradTest.test_backwards_nested_python_udf_sparse",
            "TensorPipeAgentDistAutogradTest.test_mixed_requires_grad_sparse",
            "TensorPipeAgentDistAutogradTest.test_multiple_backward_sparse",
            "TensorPipeAgentDistAutogradTest.test_nested_backward_accumulate_grads_sparse",
            "TensorPipeAgentDistAutogradTest.test_trainer_ps_sparse",
            "TensorPipeAgentDistAutogradTest.test_embedding_bag_with_no_grad_tensors",
            "DistAutogradTest.test_no_grad_copy_sparse",
            "DistAutogradTest.test_grad_copy_sparse_indices_extra_ref",
            "DdpComparisonTest.test_ddp_dist_autograd_sparse_grads",
        ),
    ),
    "DDP inside distributed autograd": (
        "Gradients differ from the local run (\"Tensor-likes are not close\"); the uneven-"
        "inputs variant times out. Probable cause: torch's DDP reducer (C++) puts its "
        "all-reduced gradients into torch's own thread-local distributed-autograd context "
        "when one is active; ucxrpc's context is a Python object the reducer cannot see.",
        (
            "DdpUnderDistAutogradTest.test_backward_ddp_inside",
            "DdpUnderDistAutogradTest.test_backward_ddp_outside",
            "DdpUnderDistAutogradTest.test_backward_ddp_outside_uneven_inputs",
            "DdpComparisonTest.test_ddp_comparison",
            "DdpComparisonTest.test_ddp_comparison_uneven_inputs",
            "DdpComparisonTest.test_ddp_dist_autograd_local_vs_remote",
        ),
    ),
    "Distributed autograd semantics": (
        "`test_no_grad_copy`: two leaves get one and the same gradient buffer where torch "
        "copies (an in-place change to one gradient changes the other); "
        "`test_post_hooks`: hooks on AccumulateGrad nodes fire a different number of times; "
        "`test_backward_unused_send_function`: backward returns where torch keeps waiting "
        "for the unused send function; "
        "`test_backward_autograd_engine_error`: the error is not torch's \"Error on Node N: "
        "...\" form.",
        (
            "DistAutogradTest.test_no_grad_copy",
            "DistAutogradTest.test_post_hooks",
            "DistAutogradTest.test_backward_unused_send_function",
            "DistAutogradTest.test_backward_autograd_engine_error",
        ),
    ),
    "Futures: wait_all exits early": (
        "`torch.futures.wait_all` does not fail as soon as one future fails; it waits for "
        "the slow one (here until its 60 s timeout), whose timeout then comes out first. "
        "ucxrpc fails a future with `torch.futures.Future.set_exception`, which completes "
        "the C++ future with a *value* (the exception, raised by an unwrap function on "
        "`wait()`); torch's C++ `collectAll` exits early only on a C++ error. From Python, "
        "the only way to give a future a C++ error is an exception in a `then()` callback, "
        "which torch turns into a RuntimeError (\"Got the following error when running the "
        "callback: ...\"), losing the remote exception's type (`test_wait_all_exit_early_"
        "python` wants the ValueError).",
        (
            "RpcTest.test_wait_all_exit_early_python",
            "RpcTest.test_wait_all_exit_early_builtin",
        ),
    ),
}
