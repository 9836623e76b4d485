"""torch RPC tests that do not apply to ucxrpc, each with the reason.

Everything the runner generates (``suites.py``) and that is not listed here
is the *public set*: tests that touch only torch's public RPC API, which
ucxrpc claims to implement.  A listed test is not run by default
(``run.py --include-excluded`` runs them too, for curiosity's sake).

How the list was made: every test method of the generated suites, together
with the helpers it reaches (the suite's own ``self._...`` methods and the
test module's functions, transitively, comments stripped), was scanned for
the markers of each category below; the hits are the evidence given per test,
and each was read by hand.  Judgement calls:

* ``RemoteModuleTest`` helpers build a scripted RemoteModule unless a test
  passes ``modes=[ModuleCreationMode.MODULE_CTOR]``; tests that do are
  public.  ``test_unsupported_methods`` calls ``remote_module.cuda()`` to
  check it is refused: public, not a CUDA test.
* Sparse tensors' own ``_values()`` / ``_indices()`` are torch tensor API,
  not RPC internals: those tests are public.
* ``rpc.api.get_worker_info()`` (a public function reached through torch's
  module path) is public; ``RPCExecMode`` is a plain enum the tests' helpers
  dispatch on (the shim hands out torch's).
* Attributes of classes the test module itself defines
  (``SimulateBackwardError._simulate_error``) are not torch internals.
* Profiler tests are public unless they run TorchScript: their ``torch.jit``
  markers are ``isinstance(func, torch.jit.ScriptFunction)`` checks and
  ``torch.jit._builtins._find_builtin`` (a builtin's name), and
  ``internal._build_rpc_profiling_key``, with which they compute the names
  they expect, is a string format, like ``RPCExecMode`` a helper of the
  tests (the shim hands out torch's).  ``torch.autograd.profiler``'s own
  private calls (``_call_end_callbacks_on_future``, the ``profiler::`` ops)
  are torch's profiler API, not RPC internals.

Keys are ``<torch suite>.<test>``; the generated class is ``Ucx<torch suite>``.
"""

from __future__ import annotations

__all__ = ["CATEGORIES", "EXCLUDED", "EXCLUDED_SUITES"]

#: category -> why tests of that kind do not apply to ucxrpc.
CATEGORIES: dict[str, str] = {
    "jit": "TorchScript: script functions over RPC, scripted RemoteModules, "
           "RRef[T] in TorchScript. ucxrpc has no TorchScript RPC.",
    "platform": "torch skips it on this platform itself.",
    "cuda": "Needs CUDA devices (device maps, skip_if_lt_x_gpu): the CUDA suites are a "
            "separate contract, checked on a GPU machine, not here.",
    "agent": "TensorPipe agent specifics (TensorPipeRpcBackendOptions, its transports) or "
             "torch's backend registry (register_backend, inferring a backend from "
             "options): another agent's configuration, not the RPC API.",
    "internal": "torch internals: underscore names of torch.distributed.rpc / .autograd / "
                "RRef / RemoteModule (agent objects, pickler hooks, debug counters, "
                "send/recv autograd functions, _set_rpc_timeout, ...).",
    "faulty": "Needs torch's faulty agent (fault injection into its C++ message loop).",
}

#: torch suites not generated at all -> (category, note).  Counts are of
#: torch 2.13.0.
EXCLUDED_SUITES: dict[str, tuple[str, str]] = {
    "JitRpcTest": ("jit", "54 tests; module compiles TorchScript against torch's RPC"),
    "JitDistAutogradTest": ("jit", "4 tests"),
    "JitFaultyAgentRpcTest": ("faulty", "6 tests; JIT too"),
    "FaultyAgentRpcTest": ("faulty", "20 tests"),
    "FaultyAgentDistAutogradTest": ("faulty", "2 tests"),
    "CudaRpcTest": ("cuda", "1 test"),
    "CudaDistAutogradTest": ("cuda", "3 tests"),
    "CudaRemoteModuleTest": ("cuda", "4 tests"),
    "CudaDdpComparisonTest": ("cuda", "1 test"),
    "TensorPipeAgentCudaRpcTest": ("cuda", "87 tests; TensorPipe's device maps"),
    "TensorPipeCudaDistAutogradTest": ("cuda", "3 tests"),
}

#: ``"<suite>.<test>"`` -> (category, the names that put it there).
EXCLUDED: dict[str, tuple[str, str]] = {
    # DistAutogradTest
    "DistAutogradTest.test_autograd_context":
        ("internal", "dist_autograd._get_max_id, dist_autograd._retrieve_context"),
    "DistAutogradTest.test_backward_simple_script_call": ("jit", "script function my_script_add"),
    "DistAutogradTest.test_clean_context_during_backward":
        ("internal",
         "context._context_id, context._send_functions, dist_autograd._new_context, "
         "dist_autograd._release_context"),
    "DistAutogradTest.test_context_cleanup_nested_rpc":
        ("internal", "dist_autograd._retrieve_context"),
    "DistAutogradTest.test_context_cleanup_no_tensors":
        ("internal", "dist_autograd._retrieve_context"),
    "DistAutogradTest.test_context_cleanup_tensor_no_grad":
        ("internal", "dist_autograd._retrieve_context"),
    "DistAutogradTest.test_context_cleanup_tensor_with_grad":
        ("internal", "dist_autograd._retrieve_context"),
    "DistAutogradTest.test_debug_info":
        ("internal", "dist_autograd._get_debug_info, dist_autograd._retrieve_context"),
    "DistAutogradTest.test_graph_for_builtin_call":
        ("internal",
         "ctx._context_id, ctx._recv_functions, ctx._send_functions, "
         "dist_autograd._current_context, dist_autograd._retrieve_context"),
    "DistAutogradTest.test_graph_for_builtin_remote_call":
        ("internal",
         "ctx._context_id, ctx._recv_functions, ctx._send_functions, "
         "dist_autograd._current_context, dist_autograd._retrieve_context"),
    "DistAutogradTest.test_graph_for_py_nested_call":
        ("internal",
         "ctx._context_id, ctx._recv_functions, ctx._send_functions, "
         "dist_autograd._current_context, dist_autograd._retrieve_context"),
    "DistAutogradTest.test_graph_for_py_nested_call_itself":
        ("internal",
         "ctx._context_id, ctx._recv_functions, ctx._send_functions, "
         "dist_autograd._current_context, dist_autograd._retrieve_context"),
    "DistAutogradTest.test_graph_for_py_nested_remote_call":
        ("internal",
         "ctx._context_id, ctx._recv_functions, ctx._send_functions, "
         "dist_autograd._current_context, dist_autograd._retrieve_context"),
    "DistAutogradTest.test_graph_for_py_nested_remote_call_itself":
        ("internal",
         "ctx._context_id, ctx._recv_functions, ctx._send_functions, "
         "dist_autograd._current_context, dist_autograd._retrieve_context"),
    "DistAutogradTest.test_graph_for_python_call":
        ("internal",
         "ctx._context_id, ctx._recv_functions, ctx._send_functions, "
         "dist_autograd._current_context, dist_autograd._retrieve_context"),
    "DistAutogradTest.test_graph_for_python_remote_call":
        ("internal",
         "ctx._context_id, ctx._recv_functions, ctx._send_functions, "
         "dist_autograd._current_context, dist_autograd._retrieve_context"),
    "DistAutogradTest.test_no_graph_with_tensors_not_require_grad":
        ("internal",
         "ctx._recv_functions, ctx._send_functions, dist_autograd._current_context, "
         "dist_autograd._retrieve_context"),
    "DistAutogradTest.test_no_graph_with_tensors_not_require_grad_remote":
        ("internal",
         "ctx._recv_functions, ctx._send_functions, dist_autograd._current_context, "
         "dist_autograd._retrieve_context"),
    "DistAutogradTest.test_remote_complex_args":
        ("internal", "ctx._known_worker_ids, dist_autograd._current_context"),
    "DistAutogradTest.test_rpc_complex_args":
        ("internal", "ctx._known_worker_ids, dist_autograd._current_context"),
    "DistAutogradTest.test_trainer_ps_torchscript_functions":
        ("jit",
         "script function create_torchscript_tensor, script function my_script_ref_add, "
         "api._ignore_rref_leak"),
    "DistAutogradTest.test_worker_ids_recorded":
        ("internal", "ctx._known_worker_ids, dist_autograd._current_context"),
    # RemoteModuleTest
    "RemoteModuleTest.test_forward_async":
        ("jit", "_create_remote_module_iter (scripted RemoteModule)"),
    "RemoteModuleTest.test_forward_async_script":
        ("jit", "torch.jit, _create_remote_module_iter (scripted RemoteModule)"),
    "RemoteModuleTest.test_forward_sync":
        ("jit", "_create_remote_module_iter (scripted RemoteModule)"),
    "RemoteModuleTest.test_forward_sync_script":
        ("jit", "torch.jit, _create_remote_module_iter (scripted RemoteModule)"),
    "RemoteModuleTest.test_remote_module_py_pickle_not_supported_script":
        ("jit", "torch.jit, _create_remote_module_iter (scripted RemoteModule)"),
    # RpcTest
    "RpcTest.test_profiler_rpc_key_names":
        ("platform", "@unittest.skipIf(IS_LINUX, pytorch#125365); passes on ucxrpc unskipped"),
    "RpcTest.test_async_record_function_cbs_jit_call":
        ("jit", "script function my_script_func, _jit_internal._qualified_name"),
    "RpcTest.test_build_rpc_profiling_key": ("internal", "_build_rpc_profiling_key"),
    "RpcTest.test_cannot_infer_backend_from_options":
        ("agent", "FooBackendOptions, rpc.RpcBackendOptions"),
    "RpcTest.test_debug_info":
        ("internal",
         "_rref_context_get_debug_info, api._get_current_rpc_agent, "
         "dist_autograd._get_debug_info"),
    "RpcTest.test_disable_gil_profiling":
        ("internal", "enable_gil_profiling, api._get_current_rpc_agent"),
    "RpcTest.test_duplicate_name": ("internal", "rpc._init_rpc_backend"),
    "RpcTest.test_ignore_rref_leak": ("internal", "api._ignore_rref_leak"),
    "RpcTest.test_profiler_with_script_async_rpc":
        ("jit", "script function my_script_func, profiled"),
    "RpcTest.test_profiler_with_script_async_rpc_single_threaded":
        ("jit", "script function my_script_func, profiled"),
    "RpcTest.test_profiler_with_script_remote_rpc":
        ("jit", "script function my_script_func, profiled"),
    "RpcTest.test_profiler_with_script_remote_rpc_single_threaded":
        ("jit", "script function my_script_func, profiled"),
    "RpcTest.test_profiler_with_script_sync_rpc":
        ("jit", "script function my_script_func, profiled"),
    "RpcTest.test_profiler_with_script_sync_rpc_single_threaded":
        ("jit", "script function my_script_func, profiled"),
    "RpcTest.test_py_nested_pickle": ("internal", "PythonUDF, _internal_rpc_pickler"),
    "RpcTest.test_register_rpc_backend_and_set_and_start_rpc_backend":
        ("agent", "backend_registry"),
    "RpcTest.test_rref_context_debug_info":
        ("internal", "_rref_context_get_debug_info, wait_until_pending_futures_and_users_flushed"),
    "RpcTest.test_rref_get_future": ("jit", "script function my_script_func, rref._get_future"),
    "RpcTest.test_rref_leak": ("internal", "api._ignore_rref_leak"),
    "RpcTest.test_rref_timeout":
        ("internal",
         "_rref_context_get_debug_info, get_num_owners_and_forks, rref._get_future, "
         "wait_until_owners_and_forks_on_rank, "
         "wait_until_pending_futures_and_users_flushed"),
    "RpcTest.test_rref_type_blocking": ("internal", "rref._get_type"),
    "RpcTest.test_rref_type_non_blocking": ("internal", "rref._get_type"),
    "RpcTest.test_rref_type_owner_blocking": ("internal", "rref._get_type"),
    "RpcTest.test_rref_type_owner_non_blocking": ("internal", "rref._get_type"),
    "RpcTest.test_rref_type_slow_init": ("internal", "rref._get_type"),
    "RpcTest.test_rref_type_with_error_blocking": ("internal", "rref._get_type"),
    "RpcTest.test_rref_type_with_error_non_blocking": ("internal", "rref._get_type"),
    "RpcTest.test_server_process_global_profiler":
        ("internal", "rpc._server_process_global_profile"),
    "RpcTest.test_shutdown_errors":
        ("internal", "api._broadcast_to_followers, api._delete_all_user_and_unforked_owner_rrefs"),
    "RpcTest.test_stress_heavy_rpc_torchscript": ("jit", "script function heavy_rpc_torchscript"),
    "RpcTest.test_use_rpc_pickler":
        ("internal", "_internal_rpc_pickler, _use_rpc_pickler, api._default_pickler"),
    "RpcTest.test_use_rref_after_shutdown": ("internal", "internal.serialize"),
    "RpcTest.test_wait_all": ("internal", "_thread_local_var, _wait_all"),
    "RpcTest.test_wait_all_exit_early_script_function":
        ("jit", "script function raise_func_script"),
    "RpcTest.test_wait_all_multiple_call": ("internal", "_thread_local_var, _wait_all"),
    "RpcTest.test_wait_all_raise_in_body": ("internal", "_thread_local_var, _wait_all"),
    "RpcTest.test_wait_all_raise_in_user_func": ("internal", "_thread_local_var, _wait_all"),
    "RpcTest.test_wait_all_timeout": ("internal", "_thread_local_var, _wait_all"),
    "RpcTest.test_wait_all_workers_timeout":
        ("internal", "replaces api._wait_all_workers and expects shutdown(graceful=True) to "
                     "call it and raise; ucxrpc's shutdown waits at the store's barrier, and one "
                     "that times out logs a warning and completes"),
    # TensorPipeAgentDistAutogradTest
    "TensorPipeAgentDistAutogradTest.test_backward_simple_script_call_sparse":
        ("jit", "script function my_script_add"),
    "TensorPipeAgentDistAutogradTest.test_context_cleanup_nested_rpc_sparse":
        ("internal", "dist_autograd._retrieve_context"),
    "TensorPipeAgentDistAutogradTest.test_context_cleanup_tensor_no_grad_sparse":
        ("internal", "dist_autograd._retrieve_context"),
    "TensorPipeAgentDistAutogradTest.test_context_cleanup_tensor_with_grad_sparse":
        ("internal", "dist_autograd._retrieve_context"),
    "TensorPipeAgentDistAutogradTest.test_graph_for_builtin_call_sparse":
        ("internal",
         "ctx._context_id, ctx._recv_functions, ctx._send_functions, "
         "dist_autograd._current_context, dist_autograd._retrieve_context"),
    "TensorPipeAgentDistAutogradTest.test_graph_for_builtin_remote_call_sparse":
        ("internal",
         "ctx._context_id, ctx._recv_functions, ctx._send_functions, "
         "dist_autograd._current_context, dist_autograd._retrieve_context"),
    "TensorPipeAgentDistAutogradTest.test_graph_for_py_nested_call_itself_sparse":
        ("internal",
         "ctx._context_id, ctx._recv_functions, ctx._send_functions, "
         "dist_autograd._current_context, dist_autograd._retrieve_context"),
    "TensorPipeAgentDistAutogradTest.test_graph_for_py_nested_call_sparse":
        ("internal",
         "ctx._context_id, ctx._recv_functions, ctx._send_functions, "
         "dist_autograd._current_context, dist_autograd._retrieve_context"),
    "TensorPipeAgentDistAutogradTest.test_graph_for_py_nested_remote_call_itself_sparse":
        ("internal",
         "ctx._context_id, ctx._recv_functions, ctx._send_functions, "
         "dist_autograd._current_context, dist_autograd._retrieve_context"),
    "TensorPipeAgentDistAutogradTest.test_graph_for_py_nested_remote_call_sparse":
        ("internal",
         "ctx._context_id, ctx._recv_functions, ctx._send_functions, "
         "dist_autograd._current_context, dist_autograd._retrieve_context"),
    "TensorPipeAgentDistAutogradTest.test_graph_for_python_call_sparse":
        ("internal",
         "ctx._context_id, ctx._recv_functions, ctx._send_functions, "
         "dist_autograd._current_context, dist_autograd._retrieve_context"),
    "TensorPipeAgentDistAutogradTest.test_graph_for_python_remote_call_sparse":
        ("internal",
         "ctx._context_id, ctx._recv_functions, ctx._send_functions, "
         "dist_autograd._current_context, dist_autograd._retrieve_context"),
    "TensorPipeAgentDistAutogradTest.test_no_graph_with_tensors_not_require_grad_remote_sparse":
        ("internal",
         "ctx._recv_functions, ctx._send_functions, dist_autograd._current_context, "
         "dist_autograd._retrieve_context"),
    "TensorPipeAgentDistAutogradTest.test_no_graph_with_tensors_not_require_grad_sparse":
        ("internal",
         "ctx._recv_functions, ctx._send_functions, dist_autograd._current_context, "
         "dist_autograd._retrieve_context"),
    "TensorPipeAgentDistAutogradTest.test_remote_complex_args_sparse":
        ("internal", "ctx._known_worker_ids, dist_autograd._current_context"),
    "TensorPipeAgentDistAutogradTest.test_rpc_complex_args_sparse":
        ("internal", "ctx._known_worker_ids, dist_autograd._current_context"),
    # TensorPipeAgentRpcTest
    "TensorPipeAgentRpcTest.test_dynamic_rpc_existing_rank_can_communicate_with_new_rank_cuda":
        ("cuda", "set_device_map, skip_if_lt_x_gpu"),
    "TensorPipeAgentRpcTest.test_infer_backend_from_options":
        ("agent",
         "TensorPipeAgent, TensorPipeRpcBackendOptions, _transports, tp_transports, "
         "api._get_current_rpc_agent"),
    "TensorPipeAgentRpcTest.test_rref_get_type_timeout_blocking":
        ("internal", "slow_rref._get_type"),
    "TensorPipeAgentRpcTest.test_rref_get_type_timeout_non_blocking":
        ("internal", "slow_rref._get_type"),
    "TensorPipeAgentRpcTest.test_rref_proxy_timeout": ("internal", "result._get_future"),
    "TensorPipeAgentRpcTest.test_set_and_get_num_worker_threads":
        ("agent",
         "TensorPipeRpcBackendOptions, _transports, tp_transports, "
         "api._get_current_rpc_agent"),
    # ThreeWorkersRemoteModuleTest
    "ThreeWorkersRemoteModuleTest.test_send_remote_module_over_the_wire":
        ("internal", "_REMOTE_MODULE_PICKLED_ATTRIBUTES"),
    "ThreeWorkersRemoteModuleTest.test_send_remote_module_over_the_wire_script_not_supported":
        ("internal",
         "_REMOTE_MODULE_PICKLED_ATTRIBUTES, _create_remote_module_iter (scripted "
         "RemoteModule)"),
}
