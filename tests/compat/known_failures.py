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
        "for the unused send function; `test_multiple_backward_with_errors`: after a failed "
        "backward the context is gone (\"Could not find autograd context\"); "
        "`test_backward_autograd_engine_error`: the error is not torch's \"Error on Node N: "
        "...\" form; `test_backward_invalid_args`: None roots give \"'NoneType' object is "
        "not iterable\" instead of torch's TypeError \"incompatible function arguments\".",
        (
            "DistAutogradTest.test_no_grad_copy",
            "DistAutogradTest.test_post_hooks",
            "DistAutogradTest.test_backward_unused_send_function",
            "DistAutogradTest.test_multiple_backward_with_errors",
            "DistAutogradTest.test_backward_autograd_engine_error",
            "DistAutogradTest.test_backward_invalid_args",
        ),
    ),
    "Futures: wait_all and blocking callbacks": (
        "`torch.futures.wait_all` does not fail as soon as one future fails; it waits for "
        "the slow one (here until its 60 s timeout). ucxrpc completes a failed future "
        "with `torch.futures.Future.set_exception`, which torch's C++ `collectAll` sees as "
        "a value, not an error, so it never exits early; besides, a second call from one "
        "worker to another sometimes waits for the first, blocked one to finish (observed "
        "outside the suite too). `test_callback_with_ret`: a `.then()` callback that "
        "itself waits on another RPC times out (probably the callback runs on the thread "
        "that would deliver that RPC's reply).",
        (
            "RpcTest.test_wait_all_exit_early_python",
            "RpcTest.test_wait_all_exit_early_builtin",
            "RpcTest.test_callback_with_ret",
        ),
    ),
    "Errors and validation": (
        "Where torch raises a given type or message and ucxrpc raises another. Names: "
        "`WorkerInfo(\"abc*\", 0)` is accepted (torch: RuntimeError \"Worker name must "
        "match\"), a duplicate name is reported in another form (torch: \"is not unique\"); "
        "`to=1.5` gives TypeError (torch: ValueError); `backend=\"TENSORPIPE\"` gives "
        "ValueError (torch: TypeError \"Argument backend must be a member of "
        "BackendType\"); a function "
        "missing on the callee; an exception whose reconstruction fails does not say "
        "\"Original exception on remote side was\"; nothing about a failing user function "
        "reaches the callee's stderr (torch logs it); `rref.remote().non_exist()` raises "
        "nothing (torch: AttributeError at the call); `RRef.__str__`, `local_value()` off "
        "the owner, pickling an RRef outside RPC, `RRef.backward` on a non-tensor, "
        "the API before `init_rpc` "
        "(\"Current RPC agent is not set!\"), static/dynamic mix, and a builtin called "
        "with bad arguments (TypeError on the caller; torch: RuntimeError from the callee).",
        (
            "RpcTest.test_invalid_names",
            "RpcTest.test_duplicate_name_2",
            "RpcTest.test_send_to_rank",
            "RpcTest.test_wrong_types",
            "RpcTest.test_function_not_on_callee",
            "RpcTest.test_custom_exception_throw_during_reconstruction",
            "RpcTest.test_py_raise_in_user_func",
            "RpcTest.test_rref_proxy_non_exist",
            "RpcTest.test_rref_str",
            "RpcTest.test_local_value_not_on_owner",
            "RpcTest.test_rref_py_pickle_not_supported",
            "RpcTest.test_owner_rref_backward",
            "RpcTest.test_user_rref_backward",
            "RpcTest.test_pg_init_no_rpc_init",
            "TensorPipeAgentRpcTest.test_dynamic_and_static_init_rpc_together",
            "TensorPipeAgentRpcTest.test_op_with_invalid_args",
        ),
    ),
    "RemoteModule": (
        "A RemoteModule cannot be sent over RPC at all (torch sends it, less the "
        "attributes added after construction); no `RemoteModule.init_from_module_rref`; "
        "a module_cls that builds no nn.Module gives TypeError (torch: ValueError "
        "\"Expect `module_cls(*args, **kwargs)` returns an instance of <class "
        "nn.Module>\"); the refusal messages differ from torch's (\"... Please use "
        "``remote_parameters`` instead.\", \"Cannot pickle RemoteModule in python "
        "pickler\").",
        (
            "RemoteModuleTest."
            "test_send_remote_module_with_a_new_attribute_not_pickled_over_the_wire",
            "ThreeWorkersRemoteModuleTest.test_create_remote_module_from_module_rref",
            "RemoteModuleTest.test_bad_module",
            "RemoteModuleTest.test_unsupported_methods",
            "RemoteModuleTest.test_remote_module_py_pickle_not_supported",
        ),
    ),
}
