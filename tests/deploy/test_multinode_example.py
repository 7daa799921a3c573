"""deploy/kubernetes/examples/multinode-decode.yaml: a LeaderWorkerSet of two pods running one decode instance's
eight tensor-parallel ranks. The LeaderWorkerSet is a custom resource (beyond kubernetes-validate): its pod templates
are validated as Pods (strict), the rest by structure; the Service and the NetworkPolicy as they are. Each pod's
command, with the values LWS puts in its environment, parses with `tandem decode`'s own parser into the ranks it
should run, and the pieces agree: GPUs per pod, the rendezvous port, the Service's leader."""
from __future__ import annotations

import re
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

import decode_svc.server
from engine.args import EngineArgs
from engine.config import ParallelConfig

PATH = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes" / "examples" / "multinode-decode.yaml"
VERSION = kubernetes_validate.utils.latest_version()
LWS_ENV = {"LWS_GROUP_SIZE", "LWS_WORKER_INDEX", "LWS_LEADER_ADDRESS"}  # what the LWS controller injects
LWS_NAME, LWS_INDEX = "leaderworkerset.sigs.k8s.io/name", "leaderworkerset.sigs.k8s.io/worker-index"


@pytest.fixture(scope="module")
def objects() -> dict[str, dict]:
    return {o["kind"]: o for o in yaml.safe_load_all(PATH.read_text())}


def _templates(lws: dict) -> dict[str, dict]:
    t = lws["spec"]["leaderWorkerTemplate"]
    return {"leader": t["leaderTemplate"], "worker": t["workerTemplate"]}


def _parallel(container: dict, size: int, index: int) -> ParallelConfig:
    """The container's args as the kubelet expands them in pod `index` of a group of `size`, parsed by tandem decode's
    parser: the ParallelConfig its engine (or its node's ranks) would run with."""
    env = {"LWS_GROUP_SIZE": str(size), "LWS_WORKER_INDEX": str(index),
           "LWS_LEADER_ADDRESS": "tandem-decode-mn-0.tandem-decode-mn.default"}
    used = {m for a in container["args"] for m in re.findall(r"\$\((\w+)\)", a)}
    assert used == LWS_ENV, used
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
    assert container["command"] == ["tandem"] and args[0] == "decode"
    ns = decode_svc.server.build_parser().parse_args(args[1:])
    cfg = EngineArgs.from_cli_args(ns)
    parallel = ParallelConfig(cfg.tensor_parallel_size, cfg.nnodes, cfg.node_rank, cfg.master_addr, cfg.master_port)
    parallel.check()
    return parallel


def test_the_pod_templates_service_and_policy_are_valid_kubernetes(objects):
    lws = objects["LeaderWorkerSet"]
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1"
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    for role, template in _templates(lws).items():
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": f"tandem-decode-mn-{role}",
                                                               **template["metadata"]}, "spec": template["spec"]}
        kubernetes_validate.validate(pod, VERSION, strict=True)
    for kind in ("Service", "NetworkPolicy"):
        kubernetes_validate.validate(objects[kind], VERSION, strict=True)


def test_each_pod_runs_its_share_of_the_ranks_and_the_pieces_agree(objects):
    lws = objects["LeaderWorkerSet"]
    size = lws["spec"]["leaderWorkerTemplate"]["size"]
    templates = _templates(lws)
    ranks = []
    for index, role in enumerate(["leader"] + ["worker"] * (size - 1)):
        container = templates[role]["spec"]["containers"][0]
        p = _parallel(container, size, index)
        assert (p.nnodes, p.node_rank) == (size, index)
        assert p.ranks_per_node == container["resources"]["limits"]["nvidia.com/gpu"]  # one rank per GPU
        ranks += range(p.node_rank * p.ranks_per_node, (p.node_rank + 1) * p.ranks_per_node)
        if role == "worker":
            assert "readinessProbe" not in container and "ports" not in container  # it serves nothing
    assert ranks == list(range(p.tensor_parallel_size))  # every rank once
    leader = templates["leader"]["spec"]["containers"][0]
    ports = {x["name"]: x["containerPort"] for x in leader["ports"]}
    assert ports["rendezvous"] == p.master_port
    assert leader["readinessProbe"]["grpc"]["port"] == ports["grpc"]
    # The Service selects each group's leader (LWS labels it worker-index 0) on its gRPC port.
    svc = objects["Service"]
    assert svc["spec"]["selector"] == {LWS_NAME: lws["metadata"]["name"], LWS_INDEX: "0"}
    assert {x["name"]: x["targetPort"] for x in svc["spec"]["ports"]}["grpc"] == "grpc"
    # The pods of a group reach each other on every port (NCCL picks its own).
    rule = objects["NetworkPolicy"]["spec"]
    assert rule["podSelector"]["matchLabels"] == {LWS_NAME: lws["metadata"]["name"]}
    assert rule["ingress"] == [{"from": [{"podSelector": {"matchLabels": {LWS_NAME: lws["metadata"]["name"]}}}]}]
