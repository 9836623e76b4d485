"""TorchRL's ``RPCCollector``, unmodified, on ucxrpc.

Two collector workers run CartPole and feed the trainer over RPC; the
trainer changes its policy after each batch and pushes the weights back.
TorchRL imports ``torch.distributed.rpc`` itself and passes TensorPipe's own
options (``_transports=["uv"]``, ``BackendType.TENSORPIPE``), so run it
under the launcher, which reaches the collector processes it starts::

    pip install torchrl==0.14.1 "gymnasium<1.0"
    python -m ucxrpc.torch_rpc examples/libraries/torchrl_rpc_collector.py [port]

Without ``-m ucxrpc.torch_rpc`` the same file runs on torch's own agent.
Prints which RPC module ran, the frames and batches collected, and the time.
"""

import sys
import time

import torch
from tensordict.nn import TensorDictModule
from torch import nn
from torchrl.collectors.distributed import RPCCollector
from torchrl.envs.libs.gym import GymEnv
from torchrl.modules import OneHotCategorical, ProbabilisticActor


def make_env():
    return GymEnv("CartPole-v1")


def make_policy():
    net = TensorDictModule(nn.Linear(4, 2), in_keys=["observation"], out_keys=["logits"])
    return ProbabilisticActor(net, in_keys=["logits"], out_keys=["action"],
                              distribution_class=OneHotCategorical, return_log_prob=False)


def main(port: int) -> None:
    import torch.distributed.rpc as rpc

    policy = make_policy()
    t0 = time.monotonic()
    collector = RPCCollector([make_env, make_env], policy, frames_per_batch=200,
                             total_frames=2000, launcher="mp", sync=False,
                             update_after_each_batch=True, tcp_port=port)
    frames = batches = 0
    for data in collector:
        frames += data.numel()
        batches += 1
        with torch.no_grad():  # the trainer's "step": new weights for the collectors
            for p in policy.parameters():
                p.add_(0.01)
        collector.update_policy_weights_()
    collector.shutdown()
    ours = (rpc.__doc__ or "").startswith("ucxrpc")
    print(f"rpc: {'ucxrpc' if ours else 'torch'}; frames {frames} batches {batches} "
          f"in {time.monotonic() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 29711)
