"""A worker that verifies must run the broker's target. A target worker started by hand with
another checkpoint (here the draft's folder) was registered and verified rounds, so the output
was no longer the target's own, and differed by which worker a round landed on. Now the broker
refuses it (``wrong_model``) and the worker exits 2 saying why; a copy of the target elsewhere joins,
unless it computes in another dtype than the deployment's verifiers (``wrong_numerics``)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time

from nebula_flow.client import Client
from nebula_flow.deploy import Deployment
from nebula_flow.models.identity import differences, fingerprint
from tests.conftest import deploy_config, hf_greedy


def test_a_fingerprint_tells_checkpoints_apart_and_not_where_they_lie(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    target = fingerprint(tiny_pair / "target")
    assert differences(target, fingerprint(tiny_pair / "draft")) == ["config", "weights"]
    copy = tmp_path / "copy"
    shutil.copytree(tiny_pair / "target", copy)
    raw = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**raw, "_name_or_path": str(copy), "transformers_version": "9"},
                                                 indent=4))  # (rewritten where it came from: the same model)
    assert differences(target, fingerprint(copy)) == []
    weights = next(p for p in copy.iterdir() if p.suffix == ".safetensors")
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # (one weight's last byte: another training of the same shape)
    weights.write_bytes(bytes(data))
    assert differences(target, fingerprint(copy)) == ["weights"]
    weights.unlink()  # a folder with the config and tokenizer alone (a broker's): its config is compared
    assert fingerprint(copy)["weights"] is None and differences(fingerprint(copy), target) == []
    assert differences(target, "not a fingerprint") == ["fingerprint"]


def test_the_broker_refuses_a_verifier_of_another_model_and_takes_a_copy_of_its_own(tiny_pair, tmp_path) -> None:  # noqa: ANN001
    copy = tmp_path / "target-copy"
    shutil.copytree(tiny_pair / "target", copy)
    with Deployment(deploy_config(tiny_pair, "pooled", 1, 1)) as dep:
        worker_address = dep.shards[0].worker_address

        def worker(model: str, name: str, *more: str) -> subprocess.Popen:
            return subprocess.Popen([sys.executable, "-m", "nebula_flow.cli", "worker", "--role", "target", "--model",
                                     model, "--broker", worker_address, "--name", name, *more],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        rogue = worker(str(tiny_pair / "draft"), "rogue")
        out, _ = rogue.communicate(timeout=120)
        assert rogue.returncode == 2, out
        assert (f"the broker refused to register this worker: this worker's target ({tiny_pair / 'draft'}) is not "
                f"the broker's ({tiny_pair / 'target'}): their config and weights differ") in out
        twin = worker(str(copy), "twin")
        try:
            with Client(dep.address, timeout_s=60) as c:
                deadline = time.monotonic() + 60
                while True:
                    state = c.status()
                    if "twin" in (names := [w["name"] for w in state["workers"]]):
                        break
                    assert twin.poll() is None and time.monotonic() < deadline, twin.stdout.read()
                    time.sleep(0.1)
                assert state["errors"]["wrong_model"] == 1 and "rogue" not in names
                # The same checkpoint in another dtype: its verifies round otherwise than the deployment's
                ours = {w["model"]["numerics"] for w in state["workers"] if w["role"] == "target"}
                assert ours == {"float32 on cpu"} or ours == {"bfloat16 batch-invariant on cpu"}, ours
                other = "bfloat16" if ours == {"float32 on cpu"} else "float32"
                unlike = worker(str(copy), "unlike", "--dtype", other)
                out, _ = unlike.communicate(timeout=120)
                assert unlike.returncode == 2, out
                assert (f"this worker verifies in {'bfloat16 batch-invariant' if other == 'bfloat16' else 'float32'} "
                        f"on cpu, the deployment's other verifiers in {ours.pop()}: a request's output would depend "
                        "on which worker verified it") in out
                assert c.status()["errors"]["wrong_numerics"] == 1
                prompt = [5, 6, 7, 8]
                outs = [c.generate(token_ids=prompt, max_new_tokens=12, ignore_eos=True).token_ids for _ in range(4)]
        finally:
            twin.terminate()
            twin.wait(timeout=30)
    assert all(o == hf_greedy(tiny_pair / "target", prompt, 12) for o in outs)  # (whichever target verified)
