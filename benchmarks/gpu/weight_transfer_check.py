"""vLLM's NCCL weight transfer into ``unsloth-rollout serve`` on one CUDA machine: TRL's client pushes a trainer's
weights over NCCL and the server then generates from them.

    python benchmarks/gpu/weight_transfer_check.py [--models /tmp/models] [--size tiny] [--json OUT]
    python benchmarks/gpu/weight_transfer_check.py --backend gloo     # the same checks on CPU, over gloo

The function is ``check_nccl_weight_transfer(model_dir, log_path)``. One GPU holds both ends: the server (a
subprocess started with ``--weight-transfer-config '{"backend": "nccl"}'``) and this process, the trainer. NCCL
refuses two ranks of one communicator on one device of one host, so each end runs with its own ``NCCL_HOSTID``
(NCCL then sees two hosts and moves the bytes over its socket transport, on loopback); with the trainer and the
server on different GPUs or machines none of that is needed.

The trainer is TRL 1.16's ``VLLMClient`` as shipped when TRL is importable (vLLM is not installed here:
``unsloth_rollout.testing.trl_cpu.allow_grpo_server_mode_without_vllm`` supplies the three vLLM functions it calls:
``get_ip``, ``trainer_init`` and the packed broadcast producer), else ``RouteClient`` below, which posts the same
route sequence TRL's client does. Each check is recorded whatever its outcome (exit code 1 if any fails):

- ``joined``: ``init_communicator`` returns: the server joined vLLM's store rendezvous and the NCCL group.
- ``packed``: ``update_model_params`` of a changed model (every parameter, packed, as TRL syncs): the weight
  version moves on by one, the server's prompt logprobs equal a forward of the trainer's model within 1e-4 (fp32,
  TF32 off) and differ from the checkpoint's by more than 1e-3, and its greedy tokens equal HF ``generate()`` on
  the trainer's model. The update's seconds and GB/s are recorded (a figure, not a check).
- ``unpacked``: vLLM's one-by-one layout (``packed: false``) and ``/finish_weight_update`` with a
  ``weight_version``: the server computes the checkpoint again and stamps that version.
- ``refused``: a tensor of the wrong shape is received, refused with 400 naming it, nothing is written, and the
  server keeps serving (version and logprobs unchanged, not paused).

``--backend gloo`` runs the same script on CPU over gloo (TRL's client through
``testing.trl_cpu.allow_grpo_server_mode_on_cpu``): a smoke test of the script itself on a machine without a GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor

import torch

TOL = 1e-4
SEQ = [7, 8, 9, 10, 11, 12, 13, 14]
# The two ends on one GPU: NCCL's socket transport on loopback, no InfiniBand probing.
NCCL_ENV = {"NCCL_SOCKET_IFNAME": "lo", "NCCL_IB_DISABLE": "1", "NCCL_NET": "Socket", "NCCL_DEBUG": "WARN"}


class RouteClient:
    """The route sequence of TRL 1.16's ``VLLMClient`` weight sync, for a trainer without TRL: ``init_communicator``
    (``/init_weight_transfer_engine`` posted while this process hosts the rendezvous), ``update_named_params``
    (``/start_weight_update``, ``/update_weights`` posted while the packed broadcast runs, ``/finish_weight_update``)
    and ``update_model_params``."""

    def __init__(self, base_url: str, group_port: int, backend: str = "nccl"):
        self.base_url, self.group_port, self.backend, self.communicator = base_url, group_port, backend, None

    def _post(self, route: str, body: dict) -> dict:
        import httpx

        r = httpx.post(self.base_url + route, json=body, timeout=600)
        if r.status_code != 200:
            raise Exception(f"Request failed: {r.status_code}, {r.text}")
        return r.json()

    def init_communicator(self, device: int = 0) -> None:
        from unsloth_rollout.models.nccl_wire import NcclTransferGroup
        from unsloth_rollout.models.weight_wire import GlooTransferGroup
        from unsloth_rollout.testing.trl_cpu import vllm_get_ip

        info = {"master_address": vllm_get_ip(), "master_port": self.group_port, "rank_offset": 1, "world_size": 2,
                "packed": True}
        if self.backend == "gloo":
            info["backend"] = "gloo"
        with ThreadPoolExecutor(1) as ex:
            future = ex.submit(self._post, "/init_weight_transfer_engine", {"init_info": info})
            if self.backend == "gloo":
                self.communicator = GlooTransferGroup(info["master_address"], self.group_port, 0, 2)
            else:
                torch.cuda.set_device(device)
                self.communicator = NcclTransferGroup.host(info["master_address"], self.group_port, 2,
                                                           device=torch.device("cuda", device))
            future.result()

    def update_named_params(self, metadata, named_params) -> None:
        from unsloth_rollout.models.weight_wire import packed_broadcast_producer

        names, dtypes, shapes = (list(x) for x in zip(*metadata))
        self._post("/start_weight_update", {})
        with ThreadPoolExecutor(1) as ex:
            future = ex.submit(self._post, "/update_weights",
                               {"update_info": {"names": names, "dtype_names": dtypes, "shapes": shapes}})
            packed_broadcast_producer(named_params, self.communicator, 0, post_iter_func=lambda item: item[1])
            future.result()
        self._post("/finish_weight_update", {})

    def update_model_params(self, model) -> None:
        params = list(model.named_parameters())
        self.update_named_params([(n, str(p.dtype).removeprefix("torch."), list(p.shape)) for n, p in params],
                                 ((n, p.data) for n, p in params))

    def close_communicator(self) -> None:
        self.communicator = None


def _client(base: str, group_port: int, backend: str):
    """(client, how, restore): TRL's ``VLLMClient`` when TRL imports, else ``RouteClient``."""
    try:
        from trl.generation.vllm_client import VLLMClient

        from unsloth_rollout.testing import trl_cpu
    except ImportError as e:
        return RouteClient(base, group_port, backend), f"route sequence (TRL not importable: {e})", lambda: None
    restore = (trl_cpu.allow_grpo_server_mode_on_cpu if backend == "gloo"
               else trl_cpu.allow_grpo_server_mode_without_vllm)()
    return VLLMClient(base_url=base, group_port=group_port, connection_timeout=60), "trl VLLMClient", restore


def _prompt_logprobs(base: str) -> torch.Tensor:
    import httpx

    body = httpx.post(base + "/v1/completions", json={"prompt": SEQ, "max_tokens": 0, "prompt_logprobs": 0},
                      timeout=120).json()
    return torch.tensor([next(iter(d.values()))["logprob"] for d in body["choices"][0]["prompt_logprobs"][1:]],
                        dtype=torch.float64)


def _model_logprobs(model) -> torch.Tensor:
    ids = torch.tensor([SEQ], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, ids[0, 1:].unsqueeze(1)).squeeze(1).double().cpu()


def _greedy(base: str, model, prompt: list[int], n: int = 12) -> tuple[list[int], list[int]]:
    import httpx

    got = httpx.post(base + "/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                    "return_token_ids": True}, timeout=120).json()
    with torch.no_grad():
        ref = model.generate(input_ids=torch.tensor([prompt], device=model.device), max_new_tokens=n, do_sample=False)
    return got["choices"][0]["token_ids"], ref[0, len(prompt):].tolist()


def _version(base: str) -> int:
    import httpx

    return httpx.get(base + "/get_weight_version", timeout=30).json()["weight_version"]


def check_nccl_weight_transfer(model_dir: str, log_path: str, timeout_s: float = 120.0,
                               backend: str = "nccl") -> dict:
    """Run the checks of the module docstring against a server on ``model_dir`` (a Qwen2 text model folder);
    returns ``{"client", "checks": {name: {"ok", ...}}, "ok"}``. ``backend="gloo"``: the same on CPU."""
    import httpx
    from transformers import AutoModelForCausalLM

    from unsloth_rollout.testing.server import free_port, serve_subprocess

    device = "cuda" if backend == "nccl" else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.environ.update(VLLM_HOST_IP="127.0.0.1")
    server_env = {}
    if backend == "nccl":
        os.environ.update(NCCL_ENV, NCCL_HOSTID="unsloth-rollout-trainer")
        server_env = {**NCCL_ENV, "NCCL_HOSTID": "unsloth-rollout-server"}
    checks: dict[str, dict] = {}
    report = {"model": model_dir, "backend": backend, "torch": torch.__version__, "checks": checks,
              "device": torch.cuda.get_device_name(0) if device == "cuda" else "cpu"}
    config = json.dumps({"backend": backend, "timeout_s": timeout_s})
    with serve_subprocess(model_dir, "--device", device, "--dtype", "float32", "--max-model-len", "256",
                          "--kv-cache-memory-bytes", "256MiB", "--weight-transfer-config", config,
                          log_path=log_path, env=server_env) as base:
        client, report["client"], restore = _client(base, free_port(), backend)
        try:
            try:
                if backend == "nccl":
                    from unsloth_rollout.models.nccl_wire import NcclLibrary

                    report["nccl"] = NcclLibrary().version()
                t0 = time.perf_counter()
                client.init_communicator(device=0)
                checks["joined"] = {"ok": True, "seconds": round(time.perf_counter() - t0, 3)}
            except Exception:  # noqa: BLE001 - recorded; nothing else can run without the group
                checks["joined"] = {"ok": False, "error": traceback.format_exc(limit=4)}
                return _done(report)
            checkpoint = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
            with torch.no_grad():  # changes far above 1e-4 that keep the logits' scale
                params = dict(model.named_parameters())
                params["model.layers.1.mlp.down_proj.weight"].mul_(-1.0)
                params["model.layers.0.self_attn.q_proj.weight"].mul_(1.5)

            def packed():
                before = _version(base)
                nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
                if device == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                client.update_model_params(model)
                seconds = time.perf_counter() - t0
                got, want = _prompt_logprobs(base), _model_logprobs(model)
                greedy = [_greedy(base, model, p) for p in ([5, 6, 7, 8], [40, 41, 42])]
                moved = float((got - _model_logprobs(checkpoint)).abs().max())
                err = float((got - want).abs().max())
                return {"ok": _version(base) == before + 1 and err <= TOL and moved > 1e-3
                        and all(a == b for a, b in greedy), "max_abs_err": err, "moved": moved,
                        "version": [before, _version(base)], "greedy_equal": [a == b for a, b in greedy],
                        "seconds": round(seconds, 4), "bytes": nbytes, "gb_per_s": round(nbytes / seconds / 1e9, 3)}

            def unpacked():
                from unsloth_rollout.models.weight_wire import broadcast_one_by_one_producer

                named = list(checkpoint.named_parameters())
                info = {"names": [n for n, _ in named], "dtype_names": ["float32"] * len(named),
                        "shapes": [list(p.shape) for _, p in named], "packed": False}
                assert httpx.post(base + "/start_weight_update", json={}, timeout=60).status_code == 200
                with ThreadPoolExecutor(1) as ex:
                    fut = ex.submit(httpx.post, base + "/update_weights", json={"update_info": info}, timeout=600)
                    broadcast_one_by_one_producer(((n, p.data) for n, p in named), client.communicator, 0)
                    status = fut.result().status_code
                fin = httpx.post(base + "/finish_weight_update", json={"weight_version": 41}, timeout=60).json()
                err = float((_prompt_logprobs(base) - _model_logprobs(checkpoint)).abs().max())
                return {"ok": status == 200 and fin.get("weight_version") == 41 and _version(base) == 41
                        and err <= TOL, "status": status, "finish": fin, "max_abs_err": err}

            def refused():
                before_lp, before_v = _prompt_logprobs(base), _version(base)
                name, bad = "model.layers.0.self_attn.q_proj.weight", torch.zeros(64, 65, device=device)
                try:
                    client.update_named_params([(name, "float32", [64, 65])], iter([(name, bad)]))
                    message = "accepted"
                except Exception as e:  # noqa: BLE001 - the 400 is the expected outcome
                    message = str(e)
                paused = httpx.get(base + "/is_paused", timeout=30).json()["is_paused"]
                same = torch.equal(_prompt_logprobs(base), before_lp)
                return {"ok": "400" in message and name in message and "shape [64, 65]" in message and same
                        and _version(base) == before_v and paused is False, "message": message[:300],
                        "unchanged": same, "paused": paused}

            for name, fn in (("packed", packed), ("unpacked", unpacked), ("refused", refused)):
                try:
                    checks[name] = fn()
                except Exception:  # noqa: BLE001 - recorded, the next check still runs
                    checks[name] = {"ok": False, "error": traceback.format_exc(limit=4)}
        finally:
            client.close_communicator()
            restore()
    return _done(report)


def _done(report: dict) -> dict:
    report["ok"] = bool(report["checks"]) and all(c.get("ok") for c in report["checks"].values())
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--models", default="/tmp/models", help="folder of model builds (made there when missing)")
    ap.add_argument("--size", default="tiny", help="unsloth_rollout.testing.tiny size of the Qwen2 model")
    ap.add_argument("--json", default=None, help="write the report here")
    ap.add_argument("--log", default=None, help="the server's log (default: next to --json, else /tmp)")
    ap.add_argument("--backend", choices=("nccl", "gloo"), default="nccl",
                    help="nccl: the check (CUDA); gloo: the same script on CPU")
    args = ap.parse_args(argv)
    if args.backend == "nccl" and not torch.cuda.is_available():
        print("no CUDA device: the NCCL check needs one (--backend gloo runs the script on CPU)", file=sys.stderr)
        return 2
    from unsloth_rollout.testing.tiny import build_tiny_model

    model_dir = os.path.join(args.models, f"qwen2-{args.size}")
    if not os.path.exists(os.path.join(model_dir, "unsloth_rollout_tiny.json")):
        build_tiny_model("qwen2", args.size, out=model_dir)
    log = args.log or (os.path.splitext(args.json)[0] + "_server.log" if args.json
                       else "/tmp/weight_transfer_server.log")
    report = check_nccl_weight_transfer(model_dir, log, backend=args.backend)
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    if not report["ok"]:
        print(f"server log ({log}), last lines:\n" + open(log).read()[-3000:], file=sys.stderr)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
