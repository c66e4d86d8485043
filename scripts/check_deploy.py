#!/usr/bin/env python3
"""Checks of deploy/ that need Python: called by scripts/check-deploy.sh.

Renders the Helm chart with Helm's own Go SDK (helm-python-sdk, the same
engine as `helm template`), lints it, validates every rendered object
against the Kubernetes JSON schemas in strict mode (kubernetes-validate),
checks that the objects fit together (selectors, named ports, probes, the
CLI contract, the config file, mutual TLS: certificates, their mounts and
flags, identities and DNS names, the optional reward server and the actors'
[reward] table, the optional environment server and the actors'
[actor.env] table, the optional vLLM container of the actor pods and the
actors' [actor.vllm] table), and that the copies of the dashboard, the
rules and the vLLM worker extension inside the chart equal the originals.
It writes every PromQL expression of the dashboard into a rules file for
promtool to parse.

Prints one line per check and exits non-zero if any failed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
import tomllib
from pathlib import Path
from typing import Any, Callable

import yaml

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "bapo"
CI_VALUES = CHART / "ci"

# Kubernetes versions whose schemas every object must pass (strict).
KUBE_VERSIONS = ["1.30.0", "1.37.0"]
# Custom resources: no schema in kubernetes-validate; checked by hand below.
CRDS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"),
    ("monitoring.coreos.com/v1", "PrometheusRule"),
    ("keda.sh/v1alpha1", "ScaledObject"),
    ("cert-manager.io/v1", "Certificate"),
    ("cert-manager.io/v1", "Issuer"),
}
RELEASE, NAMESPACE = "rl", "train"

results: list[tuple[bool, str, str]] = []


def check(name: str, fn: Callable[[], Any]) -> Any:
    """Runs one check; an AssertionError (or any error) is a failure."""
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001 - every failure is reported
        msg = f"{type(e).__name__}: {e}" if not isinstance(e, AssertionError) else str(e)
        results.append((False, name, msg))
        print(f"FAIL {name}\n" + textwrap.indent(msg.rstrip(), "     "), flush=True)
        return None
    results.append((True, name, ""))
    print(f"ok   {name}", flush=True)
    return out


def note(msg: str) -> None:
    print(f"note {msg}", flush=True)


# ---------------------------------------------------------------- rendering


def render(values: dict, release: str = RELEASE) -> list[dict]:
    import helm_python as helm

    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(values, name=release, namespace=NAMESPACE, is_install=True)
    docs = []
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc.setdefault("__source", path)
                docs.append(doc)
    return docs


def strip(obj: dict) -> dict:
    return {k: v for k, v in obj.items() if k != "__source"}


def lint(values: dict) -> None:
    import helm_python as helm

    report = helm.lint(str(CHART), values, strict=True, namespace=NAMESPACE, kube_version="v1.30.0")
    bad = [m for m in report.get("messages", []) if m.get("severity", 0) >= 2]
    errs = report.get("errors") or []
    assert not bad and not errs, "helm lint --strict:\n" + "\n".join(
        [f"{m.get('path')}: {m.get('error')}" for m in bad] + [str(e) for e in errs]
    )


def validate_schemas(docs: list[dict]) -> None:
    import kubernetes_validate as kv

    problems, skipped = [], set()
    for d in docs:
        if (d.get("apiVersion"), d.get("kind")) in CRDS:
            skipped.add(d["kind"])
            continue
        for ver in KUBE_VERSIONS:
            try:
                kv.validate(strip(d), ver, strict=True)
            except Exception as e:  # noqa: BLE001
                msg = getattr(e, "message", None) or str(e)
                path = "/".join(str(p) for p in getattr(e, "path", []) or [])
                problems.append(f"{d['kind']}/{d['metadata']['name']} (k8s {ver}) at {path or '.'}: {msg}")
    if skipped:
        note(f"no Kubernetes schema for custom resources {sorted(skipped)}: checked structurally instead")
    assert not problems, "\n".join(problems)


# ------------------------------------------------------- cross-object checks


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict], kind: str, name_suffix: str) -> dict:
    found = [d for d in by_kind(docs, kind) if d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, f"expected one {kind} named *{name_suffix}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def workloads(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


def matches(selector: dict, labels: dict) -> bool:
    ml = selector.get("matchLabels", {}) if "matchLabels" in selector or "matchExpressions" in selector else selector
    assert not selector.get("matchExpressions"), "matchExpressions are not checked"
    return all(labels.get(k) == v for k, v in ml.items())


def pods_selected(docs: list[dict], selector: dict) -> list[dict]:
    return [w for w in workloads(docs) if matches(selector, w["spec"]["template"]["metadata"].get("labels", {}))]


def container_ports(w: dict) -> dict:
    return {p["name"]: p["containerPort"] for c in w["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])}


def args_of(w: dict) -> list[str]:
    return w["spec"]["template"]["spec"]["containers"][0]["args"]


def flag(args: list[str], name: str) -> str:
    assert name in args, f"{args[0]}: flag {name} missing from {args}"
    return args[args.index(name) + 1]


def struct_fields(path: str, struct: str) -> set[str]:
    src = (ROOT / path).read_text()
    body = src.split(f"pub struct {struct} {{", 1)[1].split("\n}", 1)[0]
    return set(re.findall(r"^\s*pub (\w+):", body, re.M))


def buffer_fields() -> set[str]:
    return struct_fields("buffer-service/src/config.rs", "BufferConfig")


def reward_fields() -> set[str]:
    return struct_fields("actor/src/reward/config.rs", "RewardConfig")


def reward_on(values: dict) -> bool:
    return bool(values_get(values, "reward.enabled", False))


def env_fields() -> set[str]:
    return struct_fields("actor/src/env/config.rs", "EnvConfig")


def env_on(values: dict) -> bool:
    return bool(values_get(values, "env.enabled", False))


# The optional servers of the user's image that bapo calls, rendered by the
# same templates (templates/_servers.tpl): component (= values key) -> the
# chart's defaults the checks compare against, and the components that call
# it (the learner's held-out evaluation plays episodes in the environment
# too, src/commands/common.rs Scorer).
USER_SERVERS = {
    "reward": {"port": 50061, "args": ["--verifier", "math"], "port_env": "BAPO_REWARD_PORT", "replicas": 2, "clients": ["actor"],
               "client_auth": False, "dns": True},
    "env": {"port": 50071, "args": ["--env", "calculator"], "port_env": "BAPO_ENV_PORT", "replicas": 2, "clients": ["actor", "learner"],
            "client_auth": True, "dns": False},
}
# The flags the chart appends to a user server's args, and how many values
# each takes.
APPENDED_FLAGS = {"--listen": 1, "--tls-cert": 1, "--tls-key": 1, "--client-ca": 1,
                  "--allow-unauthenticated": 0, "--server-user": 1}


def sandbox_on(values: dict, comp: str) -> bool:
    """<comp>.sandbox.enabled: the pod starts as root with CAP_SETUID and
    CAP_SETGID only, and the server drops to its uid (--server-user)."""
    return bool(values_get(values, f"{comp}.sandbox.enabled", False))


def server_on(values: dict, comp: str) -> bool:
    return bool(values_get(values, f"{comp}.enabled", False))


def component(w: dict) -> str:
    return w["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def env_of(c: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in c.get("env", [])}


def check_objects(docs: list[dict], values: dict) -> None:
    """Every relation between the rendered objects that a cluster would
    only reveal at run time."""
    names = [(d["kind"], d["metadata"]["name"]) for d in docs]
    assert len(names) == len(set(names)), f"duplicate objects: {names}"
    for d in docs:
        if not d["metadata"]["name"].endswith("-dashboard"):  # may live in Grafana's namespace
            assert d["metadata"].get("namespace") == NAMESPACE, f"{d['kind']}/{d['metadata']['name']}: namespace"
        assert len(d["metadata"]["name"]) <= 63, f"name too long: {d['metadata']['name']}"

    buffer = one(docs, "StatefulSet", "-buffer")
    learner = one(docs, "StatefulSet", "-learner")
    actor = one(docs, "Deployment", "-actor")
    services = {s["metadata"]["name"]: s for s in by_kind(docs, "Service")}
    configmaps = {c["metadata"]["name"]: c for c in by_kind(docs, "ConfigMap")}

    # Services select pods and name ports those pods have.
    for s in services.values():
        sel = pods_selected(docs, s["spec"]["selector"])
        assert len(sel) == 1, f"Service {s['metadata']['name']} selects {len(sel)} workloads"
        ports = container_ports(sel[0])
        for p in s["spec"]["ports"]:
            assert p["targetPort"] in ports, f"Service {s['metadata']['name']}: no container port {p['targetPort']}"
    for sts in (buffer, learner):
        gov = services.get(sts["spec"]["serviceName"])
        assert gov and gov["spec"].get("clusterIP") == "None", f"{sts['metadata']['name']}: governing Service must exist and be headless"

    # Pods: security, /tmp, config, probes. The reward and environment
    # servers are the user's image, not bapo: no config file, no bapo flags,
    # TCP probes. The vLLM
    # container of an actor pod (engine vllm) neither: check_vllm checks it.
    for w in workloads(docs):
        wn, spec = w["metadata"]["name"], w["spec"]["template"]["spec"]
        is_reward = component(w) in USER_SERVERS
        sandboxed = is_reward and sandbox_on(values, component(w))
        assert matches(w["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"]), f"{wn}: selector"
        psc = spec["securityContext"]
        if sandboxed:
            # Root at the start only: --server-user drops it (check_server).
            assert psc.get("runAsNonRoot") is False and psc.get("runAsUser") == 0, f"{wn}: a sandboxed server starts as root"
            assert psc.get("fsGroup") == 10001, f"{wn}: fsGroup 10001 reads the key after the drop"
        else:
            assert psc.get("runAsNonRoot") is True and psc.get("runAsUser") == 10001, f"{wn}: pod must run as uid 10001, non-root"
        assert psc.get("seccompProfile", {}).get("type") == "RuntimeDefault", f"{wn}: seccomp"
        vols = {v["name"]: v for v in spec["volumes"]}
        for c in spec["containers"]:
            is_vllm = component(w) == "actor" and c["name"] == "vllm"
            sc = c["securityContext"]
            assert sc.get("readOnlyRootFilesystem") is True, f"{wn}: read-only root"
            assert sc.get("allowPrivilegeEscalation") is False, f"{wn}: privilege escalation"
            assert sc.get("capabilities", {}).get("drop") == ["ALL"], f"{wn}: capabilities"
            if sandboxed:
                assert sc["capabilities"].get("add") == ["SETUID", "SETGID"], f"{wn}: a sandboxed server holds CAP_SETUID and CAP_SETGID, nothing more"
                assert sc.get("runAsUser") == 0 and sc.get("runAsNonRoot") is False, f"{wn}: a sandboxed server's container starts as root"
            else:
                assert "add" not in sc.get("capabilities", {}), f"{wn}: no capability added"
            mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
            assert "emptyDir" in vols[mounts["/tmp"]], f"{wn}: /tmp must be an emptyDir"
            if not is_reward and not is_vllm:
                cm = vols[mounts["/etc/bapo"]]["configMap"]["name"]
                assert cm in configmaps and "bapo.toml" in configmaps[cm]["data"], f"{wn}: config map {cm}"
            for m in c["volumeMounts"]:
                assert m["name"] in vols or any(
                    t["metadata"]["name"] == m["name"] for t in w["spec"].get("volumeClaimTemplates", [])
                ), f"{wn}: mount {m['name']} has no volume"
            if not is_reward and not is_vllm:
                assert flag(c["args"], "--config") == "/etc/bapo/bapo.toml", f"{wn}: --config"
            ports = container_ports(w)
            for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
                if is_vllm:
                    continue
                p = c[probe]
                if is_reward:
                    # No gRPC health service in the reference server, and
                    # kubelet's gRPC probe cannot speak TLS.
                    assert "tcpSocket" in p and p["tcpSocket"]["port"] in ports, f"{wn}: {probe} must be a tcpSocket probe on a container port"
                elif "grpc" in p:
                    assert p["grpc"]["port"] in ports.values(), f"{wn}: {probe} port"
                else:
                    assert p["httpGet"]["port"] in ports and p["httpGet"]["path"] == "/metrics", f"{wn}: {probe}"
            assert c["resources"].get("limits", {}).get("memory"), f"{wn}: memory limit"
            env = {e["name"] for e in c.get("env", [])}
            want_env = {"HOME"} if is_vllm else {"POD_NAME", "HOME"} | (set() if is_reward else {"RUST_LOG"})
            assert want_env <= env, f"{wn}: env {env}"

    # The CLI contract.
    metrics = values_get(values, "ports.metrics", 9100)
    bgrpc, lgrpc = values_get(values, "ports.bufferGrpc", 50051), values_get(values, "ports.learnerGrpc", 50052)
    b, l, a = args_of(buffer), args_of(learner), args_of(actor)
    assert b[0] == "buffer" and l[0] == "learner" and a[0] == "actor", "subcommands"
    assert flag(b, "--listen") == f"0.0.0.0:{bgrpc}" and flag(l, "--listen") == f"0.0.0.0:{lgrpc}", "--listen"
    for args in (b, l, a):
        assert flag(args, "--metrics-listen") == f"0.0.0.0:{metrics}", "--metrics-listen"
    if values_get(values, "buffer.persistence.enabled", True):
        assert flag(b, "--data-dir") == "/data", "--data-dir"
    assert flag(l, "--out") == "/checkpoints", "--out"
    assert ("--resume" in l) == values_get(values, "learner.resume", True), "--resume"
    assert flag(a, "--actor-id") == "$(POD_NAME)", "--actor-id"
    buf_svc = next(s for s in services.values() if s["metadata"]["name"] == buffer["metadata"]["name"])
    learn_svc = services[learner["spec"]["serviceName"]]
    scheme = "https" if tls_on(values) else "http"
    want_buf = f"{scheme}://{buf_svc['metadata']['name']}.{NAMESPACE}.svc:{bgrpc}"
    want_learn = f"{scheme}://{learn_svc['metadata']['name']}.{NAMESPACE}.svc:{lgrpc}"
    assert flag(l, "--buffer") == want_buf and flag(a, "--buffer") == want_buf, f"--buffer must be {want_buf}"
    assert flag(a, "--learner") == want_learn, f"--learner must be {want_learn}"
    assert any(p["port"] == bgrpc for p in buf_svc["spec"]["ports"]), "buffer Service port"
    assert any(p["port"] == lgrpc for p in learn_svc["spec"]["ports"]), "learner Service port"

    # GPUs. With the vLLM engine the actor's GPUs are the vLLM container's
    # (check_vllm): the actor container gets none and the CPU image.
    for w, key in ((learner, "learner"), (actor, "actor")):
        gpus = values_get(values, f"{key}.gpus", 1)
        if key == "actor" and vllm_on(values):
            gpus = 0
        res = w["spec"]["template"]["spec"]["containers"][0]["resources"]
        got = res.get("limits", {}).get("nvidia.com/gpu")
        assert (got or 0) == gpus, f"{key}: nvidia.com/gpu limit {got}, want {gpus}"
        img = w["spec"]["template"]["spec"]["containers"][0]["image"]
        assert img.endswith("-cuda") == (gpus > 0) or values_get(values, "gpuImage.tag", ""), f"{key}: image {img}"
        # The CUDA image computes on the CPU unless told: `--device cuda`.
        a_w = args_of(w)
        got_device = flag(a_w, "--device") if "--device" in a_w else None
        want_device = "cuda" if gpus > 0 else None
        assert got_device == want_device, f"{key}: --device {got_device}, want {want_device}"
    assert "nvidia.com/gpu" not in json.dumps(buffer["spec"]["template"]["spec"]["containers"][0]["resources"]), "buffer GPU"
    assert [t["metadata"]["name"] for t in learner["spec"]["volumeClaimTemplates"]] == ["checkpoints"], "learner PVC"

    # The config file.
    cm = next(c for c in configmaps.values() if "bapo.toml" in c.get("data", {}))
    cfg = tomllib.loads(cm["data"]["bapo.toml"])
    if not values.get("configOverride"):
        assert {"buffer", "model", "learner", "actor", "task"} <= set(cfg), f"config tables: {sorted(cfg)}"
        unknown = set(cfg["buffer"]) - buffer_fields()
        assert not unknown, f"[buffer] keys not in BufferConfig: {sorted(unknown)}"
        unknown = set(cfg["learner"]) - struct_fields("learner/src/config.rs", "LearnerConfig")
        assert not unknown, f"[learner] keys not in LearnerConfig: {sorted(unknown)}"
        for k in ("group_size", "batch_groups", "max_staleness"):
            if k in cfg["buffer"]:
                assert isinstance(cfg["buffer"][k], int), f"[buffer] {k} must be a TOML integer"
        assert ("hf_dir" in cfg["model"]) != ("preset" in cfg["model"]), f"[model]: {cfg['model']}"

    # Actor fleet: autoscaling, PDB.
    auto = values_get(values, "actor.autoscaling.enabled", False)
    assert ("replicas" in actor["spec"]) != auto, "actor replicas must be unset exactly when autoscaling"
    for kind in ("HorizontalPodAutoscaler", "ScaledObject"):
        for h in by_kind(docs, kind):
            ref = h["spec"]["scaleTargetRef"]
            assert ref["kind"] == "Deployment" and ref["name"] == actor["metadata"]["name"], f"{kind} target {ref}"
    if auto:
        assert len(by_kind(docs, "HorizontalPodAutoscaler") + by_kind(docs, "ScaledObject")) == 1, "one autoscaler"
    for so in by_kind(docs, "ScaledObject"):
        trig = so["spec"]["triggers"][0]
        assert trig["type"] == "prometheus" and "bapo_buffer_groups" in trig["metadata"]["query"], "KEDA trigger"
        assert trig["metadata"]["serverAddress"].startswith("http"), "KEDA serverAddress"
    for pdb in by_kind(docs, "PodDisruptionBudget"):
        sel = pods_selected(docs, pdb["spec"]["selector"])
        assert len(sel) == 1 and component(sel[0]) in ("actor", *USER_SERVERS), f"PDB {pdb['metadata']['name']} must select the actors, the reward or the environment servers"
        assert pdb["metadata"]["name"] == sel[0]["metadata"]["name"], f"PDB {pdb['metadata']['name']} selects {sel[0]['metadata']['name']}"

    # NetworkPolicies: each selects one workload, its named ports exist, and
    # together they allow exactly actor->buffer, learner->buffer,
    # actor->learner (and actor->reward with reward.enabled; actor->env and
    # learner->env with env.enabled).
    comp = component
    allowed = set()
    for np in by_kind(docs, "NetworkPolicy"):
        target = pods_selected(docs, np["spec"]["podSelector"])
        assert len(target) == 1, f"NetworkPolicy {np['metadata']['name']} selects {len(target)} workloads"
        ports = container_ports(target[0])
        for rule in np["spec"].get("ingress", []):
            for p in rule.get("ports", []):
                assert p["port"] in ports, f"NetworkPolicy {np['metadata']['name']}: no port {p['port']}"
            for peer in rule.get("from", []):
                if "namespaceSelector" in peer:
                    continue  # Prometheus
                for src in pods_selected(docs, peer["podSelector"]):
                    allowed.add((comp(src), comp(target[0])))
    if by_kind(docs, "NetworkPolicy"):
        want = {("actor", "buffer"), ("learner", "buffer"), ("actor", "learner")}
        for comp, d in USER_SERVERS.items():
            if server_on(values, comp):
                want |= {(client, comp) for client in d["clients"]}
        assert allowed == want, f"NetworkPolicy allows {sorted(allowed)}, want {sorted(want)}"

    check_reward(docs, values, services, configmaps)
    check_env(docs, values, services, configmaps)
    check_vllm(docs, values, configmaps)

    # ServiceMonitor: one scrape target per workload.
    for sm in by_kind(docs, "ServiceMonitor"):
        picked = [s for s in services.values() if matches(sm["spec"]["selector"], s["metadata"]["labels"])]
        comps = sorted(s["metadata"]["labels"]["app.kubernetes.io/component"] for s in picked)
        assert comps == ["actor", "buffer", "learner"], f"ServiceMonitor scrapes {comps}"
        for s in picked:
            assert any(p["name"] == sm["spec"]["endpoints"][0]["port"] for p in s["spec"]["ports"]), "metrics port"

    # The copies inside the chart.
    for pr in by_kind(docs, "PrometheusRule"):
        want = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())
        assert pr["spec"] == {"groups": want["groups"]}, "PrometheusRule differs from deploy/prometheus/rules.yml"
    for c in configmaps.values():
        if "bapo-dashboard.json" in c.get("data", {}):
            assert c["metadata"]["labels"].get("grafana_dashboard") == "1", "dashboard label"
            want = json.loads((DEPLOY / "grafana" / "bapo-dashboard.json").read_text())
            assert json.loads(c["data"]["bapo-dashboard.json"]) == want, "dashboard ConfigMap differs"


# ------------------------------------------- reward and environment servers


def server_workload(docs: list[dict], comp: str) -> dict:
    found = [w for w in workloads(docs) if component(w) == comp]
    assert len(found) == 1 and found[0]["kind"] == "Deployment", f"expected one {comp} Deployment, found {[w['metadata']['name'] for w in found]}"
    return found[0]


def reward_workload(docs: list[dict]) -> dict:
    return server_workload(docs, "reward")


def config_of(configmaps: dict) -> dict:
    cm = next(c for c in configmaps.values() if "bapo.toml" in c.get("data", {}))
    return tomllib.loads(cm["data"]["bapo.toml"])


def inside_mount(c: dict, path: str, what: str) -> dict:
    """The read-only, whole (no subPath) mount of container c holding path."""
    d = path.rpartition("/")[0]
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    m = mounts.get(d)
    assert m, f"{what} {path} is not inside a mounted directory of {c['name']} ({sorted(mounts)})"
    assert m.get("readOnly") is True and "subPath" not in m, f"{what}: {d} must be mounted read-only and whole"
    return m


def no_leftovers(docs: list[dict], comp: str) -> None:
    comp_of = lambda o: o["metadata"].get("labels", {}).get("app.kubernetes.io/component")  # noqa: E731
    leftovers = [f"{d['kind']}/{d['metadata']['name']}" for d in docs if comp_of(d) == comp]
    assert not leftovers, f"{comp}.enabled is false, yet {leftovers}"


def check_server(docs: list[dict], values: dict, comp: str) -> dict:
    """The Deployment of a server of the user's image (reward, env): the
    user's image, command and args, then the chart's flags; its port; the
    env naming port and TLS files; the NetworkPolicies letting its clients
    (only) in and out to it. Returns the workload."""
    d = USER_SERVERS[comp]
    w = server_workload(docs, comp)
    wn, spec = w["metadata"]["name"], w["spec"]["template"]["spec"]
    c = spec["containers"][0]
    port = values_get(values, f"{comp}.port", d["port"])
    tls = tls_on(values)

    want_img = f"{values_get(values, f'{comp}.image.repository', '')}:{values_get(values, f'{comp}.image.tag', '')}"
    assert c["image"] == want_img, f"{wn}: image {c['image']}, want {want_img}"
    assert c.get("command", []) == (values_get(values, f"{comp}.command", []) or []), f"{wn}: command"
    assert w["spec"]["replicas"] == values_get(values, f"{comp}.replicas", d["replicas"]), f"{wn}: replicas"
    assert container_ports(w).get("grpc") == port, f"{wn}: container port grpc must be {comp}.port {port}"
    assert "nvidia.com/gpu" not in json.dumps(c["resources"]), f"{wn}: GPU"
    args = c.get("args", [])
    user = list(values_get(values, f"{comp}.args", d["args"]) or [])
    assert args[: len(user)] == user, f"{wn}: args {args} must start with {comp}.args {user}"
    appended = args[len(user):]
    want_flags = []
    if values_get(values, f"{comp}.listenArg", True):
        want_flags.append("--listen")
        assert appended[1:2] == [f"0.0.0.0:{port}"], f"{wn}: --listen must be 0.0.0.0:{port}, got {appended}"
    if tls and values_get(values, f"{comp}.tlsArgs", True):
        want_flags += ["--tls-cert", "--tls-key"]
    client_auth = values_get(values, f"{comp}.clientAuthArgs", d["client_auth"])
    if client_auth:
        # Under TLS the CA of the release's certificates; insecure, the
        # NetworkPolicy is the only fence (as for bapo's own --insecure).
        want_flags.append("--client-ca" if tls else "--allow-unauthenticated")
    if sandbox_on(values, comp):
        want_flags.append("--server-user")
    got_flags, i = [], 0
    while i < len(appended):
        assert appended[i] in APPENDED_FLAGS, f"{wn}: the chart appends {appended[i]!r} ({appended})"
        got_flags.append(appended[i])
        i += 1 + APPENDED_FLAGS[appended[i]]
    assert got_flags == want_flags and i == len(appended), f"{wn}: the chart appends {appended}, want flags {want_flags}"
    if client_auth and tls:
        ca = flag(appended, "--client-ca")
        inside_mount(c, ca, f"{wn} --client-ca")
        actor_ca = flag(args_of(one(docs, "Deployment", "-actor")), "--tls-ca")
        assert ca == actor_ca, f"{wn}: --client-ca {ca} must be the release's CA file ({actor_ca}, the clients' --tls-ca)"
    if sandbox_on(values, comp):
        su = flag(appended, "--server-user")
        want_su = f"{values_get(values, f'{comp}.sandbox.serverUser', 10001)}:{values_get(values, f'{comp}.sandbox.serverGroup', 10001)}"
        assert su == want_su and not su.startswith("0:"), f"{wn}: --server-user {su}, want {want_su} (not root)"
    assert "--insecure" not in args and "--config" not in args, f"{wn}: bapo's flags on the user's server"
    env = env_of(c)
    assert env.get(d["port_env"]) == str(port), f"{wn}: {d['port_env']}"
    assert ("BAPO_TLS_CERT" in env) == tls and ("BAPO_TLS_KEY" in env) == tls, f"{wn}: BAPO_TLS_* env exactly under TLS"
    assert not any(a.startswith("http") for a in args), f"{wn}: the {comp} server calls no bapo service"

    # PodDisruptionBudget exactly when asked for.
    pdbs = [p for p in by_kind(docs, "PodDisruptionBudget") if pods_selected(docs, p["spec"]["selector"]) == [w]]
    want_pdb = values_get(values, f"{comp}.podDisruptionBudget.enabled", True)
    assert len(pdbs) == (1 if want_pdb else 0), f"{wn}: {len(pdbs)} PodDisruptionBudgets, want {comp}.podDisruptionBudget.enabled={want_pdb}"

    # NetworkPolicies: its clients -> server in (only), and out when egress
    # is restricted.
    nps = by_kind(docs, "NetworkPolicy")
    if nps:
        clients = d["clients"]
        snp = [n for n in nps if pods_selected(docs, n["spec"]["podSelector"]) == [w]]
        assert len(snp) == 1, f"one NetworkPolicy for the {comp} pods"
        ingress = snp[0]["spec"].get("ingress", [])
        assert ingress, f"{comp} NetworkPolicy: no ingress rule"
        admitted = set()
        for rule in ingress:
            for peer in rule.get("from", []):
                assert set(peer) == {"podSelector"}, f"{comp} NetworkPolicy: only {clients} pods may call it, not {peer}"
                admitted |= {component(x) for x in pods_selected(docs, peer["podSelector"])}
            assert [p["port"] for p in rule.get("ports", [])] == ["grpc"], f"{comp} NetworkPolicy: the gRPC port only"
        assert admitted == set(clients), f"{comp} NetworkPolicy admits {sorted(admitted)}, want {sorted(clients)}"
        if values_get(values, "networkPolicy.restrictEgress", True):
            eg = snp[0]["spec"].get("egress", [])
            extra = values_get(values, f"{comp}.extraEgress", []) or []
            assert eg[: len(extra)] == extra, f"{comp} NetworkPolicy: egress {eg} must start with {comp}.extraEgress"
            rest = eg[len(extra):]
            if values_get(values, f"{comp}.dnsEgress", d["dns"]):
                assert len(rest) == 1 and not rest[0].get("to") and {p["port"] for p in rest[0]["ports"]} == {53}, f"{comp} NetworkPolicy: beyond {comp}.extraEgress, DNS only ({comp}.dnsEgress)"
            else:
                assert rest == [], f"{comp} NetworkPolicy: nothing beyond {comp}.extraEgress, not even DNS ({comp}.dnsEgress false): {rest}"
            for client in clients:
                cw = [x for x in workloads(docs) if component(x) == client]
                cnp = [n for n in nps if pods_selected(docs, n["spec"]["podSelector"]) == cw]
                assert len(cw) == 1 and len(cnp) == 1, f"one {client} workload and NetworkPolicy"
                assert "Egress" in cnp[0]["spec"]["policyTypes"], f"{client} NetworkPolicy restricts egress"
                ok = any(
                    any("podSelector" in t and w in pods_selected(docs, t["podSelector"]) for t in rule.get("to", []))
                    and any(p["port"] in (port, "grpc") for p in rule.get("ports", []))
                    for rule in cnp[0]["spec"].get("egress", [])
                )
                assert ok, f"{client} NetworkPolicy: no egress to the {comp} pods on {port}"
    return w


def check_endpoint(docs: list[dict], values: dict, services: dict, comp: str, w: dict, t: dict, table: str) -> None:
    """A client-side table (t, named table) pointing at the server w: the
    endpoint names a rendered ClusterIP Service of those pods and a port
    reaching the server's, grpcs:// exactly under TLS with a CA file every
    client mounts (the one it verifies bapo's servers with), grpc:// with
    insecure = true otherwise, no server_name."""
    port = values_get(values, f"{comp}.port", USER_SERVERS[comp]["port"])
    tls = tls_on(values)
    ep = t.get("endpoint", "")
    scheme, _, rest = ep.partition("://")
    assert scheme == ("grpcs" if tls else "grpc"), f"[{table}] endpoint {ep}: want {'grpcs' if tls else 'grpc'}:// ({'mutual TLS' if tls else 'insecure'})"
    host, _, ep_port = rest.rpartition(":")
    svc_name = host.split(".")[0]
    assert host == f"{svc_name}.{NAMESPACE}.svc", f"[{table}] endpoint host {host}: want <svc>.{NAMESPACE}.svc"
    svc = services.get(svc_name)
    assert svc, f"[{table}] endpoint {ep}: no Service {svc_name}"
    assert svc["spec"].get("clusterIP") != "None", f"Service {svc_name}: the {comp} Service balances over its pods (ClusterIP)"
    assert pods_selected(docs, svc["spec"]["selector"]) == [w], f"Service {svc_name} must select the {comp} pods"
    sp = [p for p in svc["spec"]["ports"] if str(p["port"]) == ep_port]
    assert sp, f"[{table}] endpoint port {ep_port}: Service {svc_name} has {[p['port'] for p in svc['spec']['ports']]}"
    tp = sp[0]["targetPort"]
    assert (container_ports(w).get(tp) if isinstance(tp, str) else tp) == port, f"Service {svc_name}: port {ep_port} reaches {tp}, not the server's {port}"
    assert "server_name" not in t, f"[{table}] server_name: the actors verify the endpoint's host"
    actor = one(docs, "Deployment", "-actor")
    client_auth = values_get(values, f"{comp}.clientAuthArgs", USER_SERVERS[comp]["client_auth"])
    if tls:
        assert t.get("ca"), f"[{table}] grpcs:// needs ca"
        for client in USER_SERVERS[comp]["clients"]:
            cw = [x for x in workloads(docs) if component(x) == client]
            assert len(cw) == 1, f"one {client} workload"
            cc = cw[0]["spec"]["template"]["spec"]["containers"][0]
            inside_mount(cc, t["ca"], f"[{table}] ca ({client})")
            assert t["ca"] == flag(cc["args"], "--tls-ca"), f"[{table}] ca {t['ca']} should be the CA the {client} verifies bapo's servers with ({flag(cc['args'], '--tls-ca')})"
            if client_auth:
                # The server's --client-ca: each client presents its own
                # certificate, the one it presents to bapo's services.
                for key, f in (("cert", "--tls-cert"), ("key", "--tls-key")):
                    assert t.get(key) == flag(cc["args"], f), f"[{table}] {key} = {t.get(key)!r}: the {client}'s own {f} ({flag(cc['args'], f)}), which the server's --client-ca checks"
                    inside_mount(cc, t[key], f"[{table}] {key} ({client})")
        if not client_auth:
            assert "cert" not in t and "key" not in t, f"[{table}] cert/key without {comp}.clientAuthArgs"
        assert not t.get("insecure"), f"[{table}] insecure under TLS"
    else:
        assert "ca" not in t, f"[{table}] ca with grpc:// (refused by the actor)"
        assert "cert" not in t and "key" not in t, f"[{table}] cert/key with grpc://"
        assert t.get("insecure") is True, f"[{table}] grpc:// beyond loopback needs insecure = true"
    # The actors roll when the file changes.
    assert "checksum/config" in actor["spec"]["template"]["metadata"].get("annotations", {}), "actors: checksum/config"


def check_reward(docs: list[dict], values: dict, services: dict, configmaps: dict) -> None:
    """The optional reward server and the actors' [reward] table: the
    endpoint names a rendered Service and port of the reward pods, its
    scheme follows TLS, the CA is a file the actors mount, the keys are
    RewardConfig's, the NetworkPolicies let actors (only) in."""
    cfg = config_of(configmaps)
    if not reward_on(values):
        no_leftovers(docs, "reward")
        if values_get(values, "config.reward", None) is None and not values.get("configOverride"):
            assert "reward" not in cfg, "reward.enabled is false: no [reward] table (the task's built-in verifier)"
        return

    w = check_server(docs, values, "reward")
    assert "reward" in cfg, "reward.enabled: the config file needs a [reward] table"
    r = cfg["reward"]
    unknown = set(r) - reward_fields()
    assert not unknown, f"[reward] keys not in RewardConfig: {sorted(unknown)}"
    check_endpoint(docs, values, services, "reward", w, r, "reward")
    for key, vk, default in (
        ("timeout_ms", "timeoutMs", 30000),
        ("retries", "retries", 3),
        ("backoff_ms", "backoffMs", 250),
        ("concurrency", "concurrency", 8),
        ("send_tokens", "sendTokens", False),
    ):
        want = values_get(values, f"reward.{vk}", default)
        assert r.get(key) == want and type(r.get(key)) is type(want), f"[reward] {key} = {r.get(key)!r}, want {want!r} (reward.{vk})"


def check_env(docs: list[dict], values: dict, services: dict, configmaps: dict) -> None:
    """The optional environment server and the actors' [actor.env] table:
    kind grpc, the endpoint names a rendered Service and port of the env
    pods, its scheme follows TLS, the CA is a file the actors mount, the
    keys are EnvConfig's and pass its checks, the tuning is the values',
    no [reward] endpoint beside it (the actor refuses both), the
    NetworkPolicies let actors (only) in."""
    cfg = config_of(configmaps)
    t = (cfg.get("actor") or {}).get("env")
    if not env_on(values):
        no_leftovers(docs, "env")
        if values_get(values, "config.actor.env", None) is None and not values.get("configOverride"):
            assert t is None, "env.enabled is false: no [actor.env] table (single-turn rollouts)"
        return

    w = check_server(docs, values, "env")
    assert isinstance(t, dict), "env.enabled: the config file needs an [actor.env] table"
    unknown = set(t) - env_fields()
    assert not unknown, f"[actor.env] keys not in EnvConfig: {sorted(unknown)}"
    assert t.get("kind") == "grpc", f"[actor.env] kind = {t.get('kind')!r}, want \"grpc\" (a bapo.v1.EnvironmentService)"
    check_endpoint(docs, values, services, "env", w, t, "actor.env")
    for key, vk, default in (
        ("max_turns", "maxTurns", 4),
        ("max_episode_tokens", "maxEpisodeTokens", 256),
        ("max_observation_tokens", "maxObservationTokens", 64),
        ("truncate", "truncate", "right"),
        ("step_timeout_ms", "stepTimeoutMs", 10000),
        ("retries", "retries", 3),
        ("backoff_ms", "backoffMs", 200),
    ):
        want = values_get(values, f"env.{vk}", default)
        assert t.get(key) == want and type(t.get(key)) is type(want), f"[actor.env] {key} = {t.get(key)!r}, want {want!r} (env.{vk})"
    ets = t.get("episode_timeout_s")
    want_ets = values_get(values, "env.episodeTimeoutSeconds", 300)
    assert isinstance(ets, float) and ets == float(want_ets), f"[actor.env] episode_timeout_s = {ets!r}, want {float(want_ets)!r} as a TOML float (env.episodeTimeoutSeconds)"
    # EnvConfig::validate, as the actor runs it at start.
    for key in ("max_turns", "max_episode_tokens", "max_observation_tokens", "step_timeout_ms"):
        assert t[key] >= 1, f"[actor.env] {key} must be at least 1"
    assert t["max_observation_tokens"] < t["max_episode_tokens"], "[actor.env] max_observation_tokens leaves no room for a model turn"
    assert t["truncate"] in ("right", "left"), f"[actor.env] truncate {t['truncate']!r}"
    assert ets > 0, "[actor.env] episode_timeout_s must be > 0"
    # The actor refuses any [reward] endpoint but the built-in one beside an
    # environment (it rewards its own episodes).
    ep = (cfg.get("reward") or {}).get("endpoint", "builtin")
    assert ep == "builtin", f"[reward] endpoint = {ep!r} with [actor.env]: the actor refuses it"
    assert not reward_on(values), "env.enabled with reward.enabled rendered; the chart must refuse it"


# ------------------------------------------------------------- vLLM engine

VLLM_EXT = ROOT / "actor" / "vllm" / "bapo_vllm_ext.py"
VLLM_EXT_CHART = CHART / "files" / "bapo_vllm_ext.py"
# The flags the chart sets on the vLLM server (flag -> value, None: a switch).
VLLM_SERVER = "vllm.entrypoints.openai.api_server"


def vllm_on(values: dict) -> bool:
    return values_get(values, "actor.engine", "burn") == "vllm"


def actor_fields() -> set[str]:
    return struct_fields("actor/src/config.rs", "ActorConfig")


def vllm_fields() -> set[str] | None:
    """The fields of the Rust struct behind [actor.vllm] (the one with
    served_model_name and weights_dir), or None while there is none."""
    for f in sorted((ROOT / "actor" / "src").rglob("*.rs")):
        src = f.read_text()
        for m in re.finditer(r"pub struct (\w+) \{", src):
            body = src[m.end():].split("\n}", 1)[0]
            fields = set(re.findall(r"^\s*pub (\w+):", body, re.M))
            if {"served_model_name", "weights_dir"} <= fields:
                return fields
    return None


def vllm_flags(args: list[str]) -> dict[str, str | None]:
    """--flag value / --flag=value / --switch as a dict; a repeated flag fails."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(args):
        a = args[i]
        assert a.startswith("-"), f"vllm: stray argument {a!r} in {args}"
        if "=" in a:
            k, v = a.split("=", 1)
            i += 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            k, v = a, args[i + 1]
            i += 2
        else:
            k, v = a, None
            i += 1
        assert k not in out, f"vllm: {k} given twice in {args}"
        out[k] = v
    return out


def health_probe(c: dict, probe: str) -> tuple[str, int]:
    """(url, urllib timeout) of an exec probe that GETs /health."""
    p = c[probe]
    assert set(p) & {"httpGet", "tcpSocket", "grpc"} == set(), (
        f"vllm: {probe} dials the pod's address, where the server (--host 127.0.0.1) does not listen"
    )
    cmd = p["exec"]["command"]
    assert cmd[:2] == ["python3", "-c"] and len(cmd) == 3, f"vllm: {probe} command {cmd}"
    m = re.fullmatch(r"import urllib\.request; urllib\.request\.urlopen\('([^']+)', timeout=(\d+)\)", cmd[2])
    assert m, f"vllm: {probe} does not GET a URL: {cmd[2]}"
    url, timeout = m.group(1), int(m.group(2))
    assert timeout < p.get("timeoutSeconds", 1), f"vllm: {probe}: urllib timeout {timeout} s must be below timeoutSeconds {p.get('timeoutSeconds', 1)}"
    return url, timeout


VLLM_LORA_RANKS = [1, 8, 16, 32, 64, 128, 256, 320, 512]


def check_vllm_lora(cfg: dict, fl: dict, env: dict) -> None:
    """With [learner.lora] the server loads adapters at run time: its LoRA
    flags hold the rank, the runtime-loading switch is on, and the actor's
    [actor.vllm] lora_rank is the learner's; without, none of them."""
    lora = (cfg.get("learner") or {}).get("lora")
    t = (cfg.get("actor") or {}).get("vllm") or {}
    if lora is None:
        assert "--enable-lora" not in fl, "vllm: --enable-lora without [learner.lora]"
        assert "lora_rank" not in t, "[actor.vllm] lora_rank without [learner.lora]"
        return
    r = lora.get("rank", 16)
    want = min(m for m in VLLM_LORA_RANKS if m >= r)
    assert "--enable-lora" in fl, "vllm: [learner.lora] set but the server lacks --enable-lora"
    assert fl.get("--max-lora-rank") == str(want), f"vllm: --max-lora-rank {fl.get('--max-lora-rank')!r}, want {want} for rank {r}"
    assert env.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING") == "1", "vllm: runtime LoRA loading is off"
    assert t.get("lora_rank") == r, f"[actor.vllm] lora_rank {t.get('lora_rank')!r}, want the learner's rank {r}"


def check_vllm(docs: list[dict], values: dict, configmaps: dict) -> None:
    """The vLLM engine (actor.engine vllm): the server container beside the
    actor, its flags, probes, GPUs and mounts, and the actor's [actor.vllm]
    table, all naming the same port, weights directory and model."""
    actor = one(docs, "Deployment", "-actor")
    spec = actor["spec"]["template"]["spec"]
    names = [c["name"] for c in spec["containers"]]
    vols = {v["name"]: v for v in spec["volumes"]}
    ext_cms = [c for c in configmaps.values() if "bapo_vllm_ext.py" in c.get("data", {})]
    cfg = config_of(configmaps)
    cfg_actor = cfg.get("actor", {})
    override = bool(values.get("configOverride"))

    if not override:
        # [actor] keys are ActorConfig's (deny_unknown_fields); engine and
        # vllm once the Rust side has them.
        fields = actor_fields()
        unknown = set(cfg_actor) - fields
        if "engine" not in fields:
            pending = unknown & {"engine", "vllm"}
            if pending:
                note(f"[actor] {sorted(pending)}: not (yet) in ActorConfig; not checked against it")
            unknown -= {"engine", "vllm"}
        assert not unknown, f"[actor] keys not in ActorConfig: {sorted(unknown)}"

    if not vllm_on(values):
        assert names == ["actor"], f"actor.engine burn: the actor pod runs {names}"
        assert not ext_cms, "actor.engine burn: no vLLM extension ConfigMap"
        assert not [v for v in vols if v.startswith("vllm-")], f"actor.engine burn: vLLM volumes {sorted(vols)}"
        if not override:
            assert "engine" not in cfg_actor and "vllm" not in cfg_actor, "actor.engine burn: [actor] engine / [actor.vllm] written"
        return

    assert names == ["actor", "vllm"], f"actor.engine vllm: containers {names}, want the actor first and then vllm"
    ac, vc = spec["containers"]
    port = values_get(values, "actor.vllm.port", 8000)
    gpus = values_get(values, "actor.gpus", 1)
    v = values_get(values, "actor.vllm", {})

    # The server's command line.
    repo = values_get(values, "actor.vllm.image.repository", "vllm/vllm-openai")
    tag = values_get(values, "actor.vllm.image.tag", "v0.32.0")
    assert vc["image"] == f"{repo}:{tag}", f"vllm: image {vc['image']}, want {repo}:{tag}"
    assert vc.get("command") == ["python3", "-m", VLLM_SERVER], f"vllm: command {vc.get('command')}"
    args = vc["args"]
    extra = list(v.get("extraArgs", []) or [])
    assert args[len(args) - len(extra):] == extra, f"vllm: args {args} must end with actor.vllm.extraArgs {extra}"
    fl = vllm_flags(args)
    model_dir = values_get(values, "model.hfDir", "")
    want = {
        "--model": model_dir,
        "--served-model-name": "bapo",
        "--host": "127.0.0.1",
        "--port": str(port),
        "--tensor-parallel-size": str(gpus),
        "--enable-scale-out": None,
        "--logprobs-mode": "processed_logprobs",
        "--worker-extension-cls": "bapo_vllm_ext.BapoWorker",
        # bapo's weight-transfer engine: versions arrive as patches in place.
        "--weight-transfer-config": '{"backend": "bapo_shm"}',
        "--dtype": values_get(values, "actor.vllm.dtype", "bfloat16"),
    }
    for k, val in want.items():
        assert k in fl and fl[k] == val, f"vllm: {k} {fl.get(k, '(missing)')!r}, want {val!r}"
    env = env_of(vc)
    assert env.get("VLLM_SERVER_DEV_MODE") == "1", "vllm: VLLM_SERVER_DEV_MODE=1 (the actor reloads weights through /collective_rpc)"
    assert env.get("HOME") == "/tmp", "vllm: HOME must be the /tmp emptyDir (read-only root)"
    check_vllm_lora(cfg, fl, env)

    # Loopback only: no container port, no probe from outside the container.
    assert not vc.get("ports"), f"vllm: container ports {vc.get('ports')}: the server listens on 127.0.0.1 only"
    for np in by_kind(docs, "NetworkPolicy"):
        for rule in np["spec"].get("ingress", []) + np["spec"].get("egress", []):
            for p in rule.get("ports", []):
                assert p.get("port") != port, f"NetworkPolicy {np['metadata']['name']} names the vLLM port {port}"
    urls = {health_probe(vc, p)[0] for p in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert urls == {f"http://127.0.0.1:{port}/health"}, f"vllm: probes ask {sorted(urls)}, want http://127.0.0.1:{port}/health (--host, --port)"
    sp = vc["startupProbe"]
    budget = sp.get("periodSeconds", 10) * sp.get("failureThreshold", 3)
    want_budget = values_get(values, "actor.vllm.startupTimeoutSeconds", 1800)
    assert want_budget <= budget < want_budget + sp.get("periodSeconds", 10), f"vllm: the startup probe allows {budget} s, want actor.vllm.startupTimeoutSeconds {want_budget}"

    # The actor's [actor.vllm] table: the same server, weights and model.
    assert cfg_actor.get("engine") == "vllm", f"[actor] engine = {cfg_actor.get('engine')!r}, want \"vllm\""
    t = cfg_actor.get("vllm")
    assert isinstance(t, dict), "engine vllm: no [actor.vllm] table"
    assert t.get("url") == f"http://127.0.0.1:{port}", f"[actor.vllm] url {t.get('url')!r}: want the sidecar http://127.0.0.1:{port}"
    assert t.get("served_model_name") == fl["--served-model-name"], "[actor.vllm] served_model_name must be the server's --served-model-name"
    assert t.get("dtype") == fl["--dtype"], f"[actor.vllm] dtype {t.get('dtype')!r} must be the server's --dtype {fl['--dtype']!r}"
    for key, vk, default in (("request_timeout_s", "requestTimeoutSeconds", 600), ("reload_timeout_s", "reloadTimeoutSeconds", 120)):
        want_v = values_get(values, f"actor.vllm.{vk}", default)
        assert t.get(key) == want_v, f"[actor.vllm] {key} = {t.get(key)!r}, want {want_v!r} (actor.vllm.{vk})"
        assert isinstance(t.get(key), int) == isinstance(want_v, int), f"[actor.vllm] {key}: a whole number must be a TOML integer"
    rust = vllm_fields()
    if rust is None:
        note("[actor.vllm]: no Rust struct with served_model_name and weights_dir in actor/src yet; keys not checked against it")
    else:
        assert not set(t) - rust, f"[actor.vllm] keys not in the Rust struct: {sorted(set(t) - rust)}"
    assert cfg["model"].get("hf_dir") == model_dir, f"[model] hf_dir {cfg['model'].get('hf_dir')!r} and vLLM's --model {model_dir!r} must be one directory"

    # Weights: the one emptyDir at weights_dir in both containers, written by
    # the actor.
    wd = t.get("weights_dir")
    assert wd == values_get(values, "actor.vllm.weightsDir", "/weights"), f"[actor.vllm] weights_dir {wd!r}, want actor.vllm.weightsDir"
    am = {m["mountPath"]: m for m in ac["volumeMounts"]}
    vm = {m["mountPath"]: m for m in vc["volumeMounts"]}
    assert wd in am and wd in vm, f"weights_dir {wd} must be mounted in both containers (actor {sorted(am)}, vllm {sorted(vm)})"
    assert am[wd]["name"] == vm[wd]["name"] and "subPath" not in am[wd] and "subPath" not in vm[wd], f"{wd}: the containers mount different volumes"
    assert "emptyDir" in vols[am[wd]["name"]], f"{wd}: the weights volume must be an emptyDir of the pod"
    assert not am[wd].get("readOnly"), f"{wd}: the actor writes the weight versions"

    # The model: --model lies on a volume mounted at the same path in both.
    def holder(mounts: dict, path: str) -> dict | None:
        best = [m for mp, m in mounts.items() if path == mp or path.startswith(mp.rstrip("/") + "/")]
        return max(best, key=lambda m: len(m["mountPath"]), default=None)

    hm_v, hm_a = holder(vm, model_dir), holder(am, model_dir)
    assert hm_v, f"vllm: --model {model_dir} is in none of its mounts {sorted(vm)}"
    assert hm_a and hm_a["mountPath"] == hm_v["mountPath"] and hm_a["name"] == hm_v["name"], f"{model_dir}: the actor and vLLM must see the model on one volume at one path"
    assert "persistentVolumeClaim" in vols[hm_v["name"]], f"{model_dir}: on a {sorted(vols[hm_v['name']])} volume"

    # /tmp and /dev/shm of the server.
    assert "emptyDir" in vols[vm["/tmp"]["name"]], "vllm: /tmp must be an emptyDir"
    assert vols.get(vm.get("/dev/shm", {}).get("name"), {}).get("emptyDir", {}).get("medium") == "Memory", "vllm: /dev/shm must be an in-memory emptyDir"

    # GPUs on the server, none on the actor.
    res = vc["resources"]
    assert gpus >= 1, f"actor.gpus {gpus}: vLLM needs a GPU"
    got = (res.get("limits", {}).get("nvidia.com/gpu"), res.get("requests", {}).get("nvidia.com/gpu"))
    assert got == (gpus, gpus), f"vllm: nvidia.com/gpu limit and request {got}, want actor.gpus {gpus}"
    assert "nvidia.com/gpu" not in json.dumps(ac["resources"]), "actor container: its GPUs went to vLLM"
    assert "--device" not in ac["args"], "actor container: no --device with engine vllm (it has no GPU)"

    # The extension: the ConfigMap holds the repository's file, mounted at a
    # directory on the server's PYTHONPATH, under the module name
    # --worker-extension-cls names; a new file rolls the pods.
    assert len(ext_cms) == 1, f"one vLLM extension ConfigMap, found {len(ext_cms)}"
    ext = ext_cms[0]
    mod, _, cls = fl["--worker-extension-cls"].rpartition(".")
    assert f"{mod}.py" in ext["data"], f"extension ConfigMap has {sorted(ext['data'])}, not {mod}.py"
    src = VLLM_EXT.read_text()
    assert ext["data"][f"{mod}.py"] == src, f"the extension ConfigMap differs from {VLLM_EXT.relative_to(ROOT)}"
    assert re.search(rf"^class {cls}\b", src, re.M), f"{VLLM_EXT.relative_to(ROOT)} defines no class {cls}"
    ext_mounts = [m for m in vc["volumeMounts"] if vols[m["name"]].get("configMap", {}).get("name") == ext["metadata"]["name"]]
    assert len(ext_mounts) == 1 and ext_mounts[0].get("readOnly") and "subPath" not in ext_mounts[0], "vllm: mount the extension ConfigMap once, read-only, whole"
    assert ext_mounts[0]["mountPath"] in (env.get("PYTHONPATH") or "").split(":"), f"vllm: PYTHONPATH {env.get('PYTHONPATH')!r} lacks {ext_mounts[0]['mountPath']}"
    import hashlib

    ann = actor["spec"]["template"]["metadata"].get("annotations", {})
    assert ann.get("checksum/vllm-ext") == hashlib.sha256(src.encode()).hexdigest(), "actors: checksum/vllm-ext must be the extension's sha256 (a new extension rolls the pods)"


# -------------------------------------------------------------- mutual TLS

# cert-manager's KeyUsage strings (cert-manager.io/v1 Certificate.spec.usages).
CM_USAGES = {
    "signing", "digital signature", "content commitment", "key encipherment",
    "key agreement", "data encipherment", "cert sign", "crl sign",
    "encipher only", "decipher only", "any", "server auth", "client auth",
    "code signing", "email protection", "s/mime", "ipsec end system",
    "ipsec tunnel", "ipsec user", "timestamping", "ocsp signing",
    "microsoft sgc", "netscape sgc",
}
EKUS = {"server auth", "client auth"}
# What each component's certificate must say (proto/src/tls.rs): the role
# (first path segment of the SPIFFE ID; the buffer only serves, "buffer" is
# no role) and exactly these extended key usages. The learner's one
# certificate serves actors and calls the buffer.
WANT_CERT = {
    "buffer": ("buffer", {"server auth"}),
    "learner": ("learner", {"server auth", "client auth"}),
    "actor": ("actor", {"client auth"}),
    "admin": ("admin", {"client auth"}),
    # The optional reward and environment servers: TLS with server
    # authentication only.
    "reward": ("reward", {"server auth"}),
    "env": ("env", {"server auth"}),
}
# Which file of a Secret (or csi-driver volume) each flag must name.
FLAG_FILE = {"--tls-cert": "tls.crt", "--tls-key": "tls.key", "--tls-ca": "ca.crt"}
CSI_FILE_ATTR = {
    "--tls-cert": "csi.cert-manager.io/certificate-file",
    "--tls-key": "csi.cert-manager.io/privatekey-file",
    "--tls-ca": "csi.cert-manager.io/ca-file",
}
GO_DURATION = re.compile(r"^([0-9]+(\.[0-9]+)?(ns|us|µs|ms|s|m|h))+$")


def tls_on(values: dict) -> bool:
    return bool(values_get(values, "tls.enabled", True)) and not values_get(values, "insecure", False)


def spiffe(uri: str) -> tuple[str, str]:
    """(trust domain, role) as bapo reads them (tls::Peer::from_spiffe_id)."""
    assert uri.startswith("spiffe://"), f"{uri}: not a SPIFFE ID"
    td, sep, path = uri[len("spiffe://"):].partition("/")
    assert td and sep and path, f"{uri}: want spiffe://<trust-domain>/<role>[/<name>]"
    return td, path.split("/")[0]


def host_of(url: str) -> str:
    return url.split("://", 1)[1].split("/", 1)[0].rsplit(":", 1)[0]


def go_hours(d: str) -> float:
    total = 0.0
    for num, unit in re.findall(r"([0-9.]+)(ns|us|µs|ms|s|m|h)", d):
        total += float(num) * {"h": 3600, "m": 60, "s": 1, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}[unit]
    return total / 3600


def check_certificate_shape(c: dict) -> None:
    """What cert-manager's CRD and webhook would refuse, checked by hand."""
    n, spec = c["metadata"]["name"], c["spec"]
    assert spec.get("secretName"), f"Certificate {n}: secretName"
    ref = spec.get("issuerRef") or {}
    assert ref.get("name"), f"Certificate {n}: issuerRef.name"
    assert set(ref) <= {"name", "kind", "group"}, f"Certificate {n}: issuerRef {ref}"
    assert any(spec.get(k) for k in ("commonName", "dnsNames", "uris", "ipAddresses", "emailAddresses")), f"Certificate {n}: no subject"
    bad = set(spec.get("usages", [])) - CM_USAGES
    assert not bad, f"Certificate {n}: unknown usages {sorted(bad)}"
    for k in ("duration", "renewBefore"):
        assert GO_DURATION.match(str(spec.get(k, ""))), f"Certificate {n}: {k} {spec.get(k)!r}"
    assert go_hours(spec["renewBefore"]) < go_hours(spec["duration"]), f"Certificate {n}: renewBefore must be shorter than duration"
    pk = spec.get("privateKey", {})
    assert pk.get("algorithm") == "ECDSA" and pk.get("size") == 256, f"Certificate {n}: ECDSA P-256 key"
    assert pk.get("rotationPolicy") in ("Always", "Never") and pk.get("encoding") in ("PKCS1", "PKCS8"), f"Certificate {n}: privateKey {pk}"
    for dns in spec.get("dnsNames", []):
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", dns) and len(dns) <= 253, f"Certificate {n}: DNS name {dns!r}"


def check_tls(docs: list[dict], values: dict) -> None:
    """Mutual TLS end to end: the objects a pod mounts exist, the flags name
    files inside them, each certificate carries its component's role,
    usages and the DNS names clients dial, the issuer chain resolves."""
    insecure = values_get(values, "insecure", False)
    cm_on = values_get(values, "tls.certManager.enabled", True)
    per_pod = values_get(values, "tls.certManager.perPodActorIdentities", False)
    existing = values_get(values, "tls.existingSecrets", {}) or {}
    issuer_name = values_get(values, "tls.certManager.issuerRef.name", "")
    ca_bundle = values_get(values, "tls.caBundle", "")
    comps = {
        "buffer": one(docs, "StatefulSet", "-buffer"),
        "learner": one(docs, "StatefulSet", "-learner"),
        "actor": one(docs, "Deployment", "-actor"),
    }
    certs, issuers = by_kind(docs, "Certificate"), by_kind(docs, "Issuer")
    configmaps = {c["metadata"]["name"]: c for c in by_kind(docs, "ConfigMap")}

    if not tls_on(values):
        assert insecure, "TLS off without insecure: bapo would refuse to start"
        assert not certs and not issuers, "insecure: no cert-manager objects expected"
        for comp, w in comps.items():
            args = args_of(w)
            assert "--insecure" in args, f"{comp}: insecure needs --insecure"
            assert not set(args) & {*FLAG_FILE, "--blocklist"}, f"{comp}: TLS flags under insecure"
            if comp != "actor":
                c = w["spec"]["template"]["spec"]["containers"][0]
                assert all("grpc" in c[p] for p in ("startupProbe", "livenessProbe", "readinessProbe")), f"{comp}: plaintext servers keep the gRPC probes"
        for comp in USER_SERVERS:
            if not server_on(values, comp):
                continue
            sw = server_workload(docs, comp)
            c = sw["spec"]["template"]["spec"]["containers"][0]
            assert not {"--tls-cert", "--tls-key"} & set(c.get("args", [])), f"{comp}: TLS flags under insecure"
            assert not any("secret" in v for v in sw["spec"]["template"]["spec"]["volumes"]), f"{comp}: a Secret volume under insecure"
            assert not {"BAPO_TLS_CERT", "BAPO_TLS_KEY"} & set(env_of(c)), f"{comp}: BAPO_TLS_* under insecure"
        return

    # Certificates: shape, and which component each one is for.
    leaf_by_comp: dict[str, dict] = {}
    by_secret = {c["spec"]["secretName"]: c for c in certs}
    assert len(by_secret) == len(certs), "two Certificates write one Secret"
    for c in certs:
        check_certificate_shape(c)
        if not c["spec"].get("isCA"):
            comp = c["metadata"]["labels"].get("app.kubernetes.io/component")
            assert comp in WANT_CERT, f"Certificate {c['metadata']['name']}: component {comp!r}"
            assert comp not in leaf_by_comp, f"two Certificates for {comp}"
            leaf_by_comp[comp] = c
    if not cm_on:
        assert not certs and not issuers, "existing Secrets: no cert-manager objects expected"
    else:
        want = {"buffer", "learner"} | (set() if per_pod else {"actor"})
        if values_get(values, "tls.certManager.adminCertificate", False):
            want.add("admin")
        want |= {comp for comp in USER_SERVERS if server_on(values, comp)}
        assert set(leaf_by_comp) == want, f"Certificates for {sorted(leaf_by_comp)}, want {sorted(want)}"

    # The issuer chain.
    cm_issuers = {i["metadata"]["name"]: i for i in issuers}
    ca_certs = [c for c in certs if c["spec"].get("isCA")]
    if cm_on and not issuer_name:
        selfsigned = [i for i in issuers if "selfSigned" in i["spec"]]
        ca_issuers = [i for i in issuers if "ca" in i["spec"]]
        assert len(selfsigned) == 1 and len(ca_issuers) == 1 and len(ca_certs) == 1, "bootstrap: self-signed Issuer, CA Certificate, CA Issuer"
        ca = ca_certs[0]
        assert ca["spec"]["issuerRef"]["name"] == selfsigned[0]["metadata"]["name"], "the CA Certificate must come from the self-signed Issuer"
        assert ca["spec"]["issuerRef"].get("kind", "Issuer") == "Issuer", "CA issuerRef kind"
        assert ca_issuers[0]["spec"]["ca"]["secretName"] == ca["spec"]["secretName"], "the CA Issuer must use the CA Certificate's Secret"
        assert "cert sign" in ca["spec"]["usages"], "CA: cert sign"
        assert ca["spec"]["privateKey"]["rotationPolicy"] == "Never", "CA: a renewed CA must keep its key, or every issued certificate stops chaining"
        want_ref = {"name": ca_issuers[0]["metadata"]["name"], "kind": "Issuer", "group": "cert-manager.io"}
    elif cm_on:
        assert not issuers and not ca_certs, "with tls.certManager.issuerRef.name, the chart makes no CA"
        want_ref = {
            "name": issuer_name,
            "kind": values_get(values, "tls.certManager.issuerRef.kind", "Issuer") or "Issuer",
            "group": values_get(values, "tls.certManager.issuerRef.group", "cert-manager.io") or "cert-manager.io",
        }
    for comp, c in leaf_by_comp.items():
        ref = c["spec"]["issuerRef"]
        assert ref == want_ref, f"{comp} Certificate issuerRef {ref}, want {want_ref}"
        if ref["kind"] == "Issuer" and not issuer_name:
            assert ref["name"] in cm_issuers, f"{comp}: Issuer {ref['name']} not rendered"

    # Identities: one trust domain, each certificate its component's role
    # and exactly its extended key usages.
    domains = set()

    def check_identity(comp: str, uris: list[str], usages: set[str], what: str) -> None:
        role, ekus = WANT_CERT[comp]
        assert uris, f"{what}: no SAN URI, so no role"
        td, got = spiffe(uris[0])
        domains.add(td)
        assert got == role, f"{what}: first SAN URI {uris[0]} has role {got!r}, want {role!r}"
        assert usages & EKUS == ekus, f"{what}: extended usages {sorted(usages & EKUS)}, want {sorted(ekus)}"
        assert "digital signature" in usages, f"{what}: digital signature (TLS handshakes sign with the key)"

    for comp, c in leaf_by_comp.items():
        check_identity(comp, c["spec"].get("uris", []), set(c["spec"]["usages"]), f"Certificate {c['metadata']['name']}")

    # Each workload: flags -> mounted files -> Secret/Certificate/csi/ConfigMap.
    mounted_secrets = set()
    for comp, w in comps.items():
        spec = w["spec"]["template"]["spec"]
        c = spec["containers"][0]
        args = c["args"]
        assert "--insecure" not in args, f"{comp}: --insecure under mutual TLS"
        assert "--tls-server-name" not in args, f"{comp}: clients should verify the host of each URL (one --tls-server-name would apply to both the buffer and the learner)"
        mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
        vols = {v["name"]: v for v in spec["volumes"]}

        def source(path: str, flag_name: str) -> tuple[dict, str]:
            d, _, key = path.rpartition("/")
            m = mounts.get(d)
            assert m, f"{comp}: {flag_name} {path} is not inside a mounted directory ({sorted(mounts)})"
            assert m.get("readOnly") is True and "subPath" not in m, f"{comp}: {d} must be mounted read-only and whole (no subPath: kubelet's in-place updates never reach a subPath)"
            return vols[m["name"]], key

        cert_vol = None
        for f, file in FLAG_FILE.items():
            path = flag(args, f)
            vol, key = source(path, f)
            if f == "--tls-cert":
                cert_vol = vol
            if "secret" in vol:
                sec = vol["secret"]
                assert not sec.get("items"), f"{comp}: Secret items would rename the files"
                name = sec["secretName"]
                mounted_secrets.add(name)
                if cm_on:
                    assert name in by_secret, f"{comp}: mounts Secret {name}, which no Certificate writes"
                    assert by_secret[name] is leaf_by_comp.get(comp), f"{comp}: mounts {name}, the Secret of another component"
                else:
                    assert name == existing.get(comp), f"{comp}: mounts Secret {name}, not tls.existingSecrets.{comp} ({existing.get(comp)!r})"
                assert key == file, f"{comp}: {f} {path}: a Secret from cert-manager or kubectl has {file}"
                mode = sec.get("defaultMode", 0o644)
                if mode & 0o004 == 0:
                    assert spec["securityContext"].get("fsGroup") is not None, f"{comp}: Secret mode {oct(mode)} without fsGroup: uid 10001 cannot read the key"
            elif "csi" in vol:
                csi = vol["csi"]
                assert comp == "actor" and per_pod, f"{comp}: unexpected csi volume"
                assert csi["driver"] == "csi.cert-manager.io" and csi.get("readOnly") is True, f"{comp}: csi-driver needs driver csi.cert-manager.io and readOnly: true"
                attrs = csi["volumeAttributes"]
                assert key == attrs.get(CSI_FILE_ATTR[f], file), f"{comp}: {f} {path}: the csi-driver writes {attrs.get(CSI_FILE_ATTR[f], file)}"
            elif "configMap" in vol:
                assert f == "--tls-ca" and ca_bundle, f"{comp}: {f} from a ConfigMap"
                cm = configmaps.get(vol["configMap"]["name"])
                assert cm and key in cm.get("data", {}), f"{comp}: --tls-ca {path}: no such ConfigMap key"
                assert cm["data"][key].count("-----BEGIN CERTIFICATE-----") == ca_bundle.count("-----BEGIN CERTIFICATE-----"), f"{comp}: CA bundle ConfigMap lost certificates"
            else:
                raise AssertionError(f"{comp}: {f} {path} is on a {sorted(vol)} volume")
        # Key and certificate from the same volume.
        assert vols[mounts[flag(args, "--tls-key").rpartition("/")[0]]["name"]] is cert_vol, f"{comp}: --tls-cert and --tls-key from different volumes"
        if "csi" in cert_vol:
            attrs = cert_vol["csi"]["volumeAttributes"]
            uris = [u.strip() for u in attrs.get("csi.cert-manager.io/uri-sans", "").split(",") if u.strip()]
            usages = {u.strip() for u in attrs.get("csi.cert-manager.io/key-usages", "").split(",")}
            assert not usages - CM_USAGES, f"{comp}: csi key-usages {usages}"
            check_identity(comp, uris, usages, f"{comp} csi volume")
            assert "${POD_NAME}" in uris[0], f"{comp}: per-pod identities need ${{POD_NAME}} in uri-sans"
            ref = {
                "name": attrs.get("csi.cert-manager.io/issuer-name"),
                "kind": attrs.get("csi.cert-manager.io/issuer-kind", "Issuer"),
                "group": attrs.get("csi.cert-manager.io/issuer-group", "cert-manager.io"),
            }
            assert ref == want_ref, f"{comp}: csi issuer {ref}, want {want_ref}"
            assert not (ref["kind"] == "Issuer" and "selfSigned" in cm_issuers.get(ref["name"], {}).get("spec", {})), "csi-driver cannot use a SelfSigned issuer"
            for k in ("csi.cert-manager.io/duration", "csi.cert-manager.io/renew-before"):
                assert GO_DURATION.match(attrs.get(k, "")), f"{comp}: {k}"
            fs = attrs.get("csi.cert-manager.io/fs-group")
            assert fs and int(fs) == spec["securityContext"].get("runAsGroup", spec["securityContext"].get("fsGroup")), f"{comp}: csi fs-group {fs} must be the pod's group"

        # Servers: the blocklist; clients: none.
        if comp in ("buffer", "learner"):
            vol, key = source(flag(args, "--blocklist"), "--blocklist")
            cm = configmaps.get(vol.get("configMap", {}).get("name"))
            assert cm and key in cm.get("data", {}), f"{comp}: --blocklist names no ConfigMap key"
            listed = {l.split("#")[0].strip() for l in cm["data"][key].splitlines()} - {""}
            assert listed == set(values_get(values, "tls.blocklist", []) or []), f"{comp}: blocklist {sorted(listed)}"
            for l in listed:
                spiffe(l)
            ann = w["spec"]["template"]["metadata"].get("annotations", {})
            assert not any("blocklist" in k for k in ann), f"{comp}: the blocklist must not roll the pods"
        else:
            assert "--blocklist" not in args, "actors serve nothing: no --blocklist"

        # Kubelet's gRPC probes speak plaintext with no client certificate.
        for p in ("startupProbe", "livenessProbe", "readinessProbe"):
            assert "grpc" not in c[p], f"{comp}: {p} is a gRPC probe, which cannot pass under mutual TLS"
        # Clients and servers follow the CA bundle in place: a new bundle
        # must not roll (and so restart) the learner or the actors.
        assert "checksum/ca-bundle" not in w["spec"]["template"]["metadata"].get("annotations", {}), f"{comp}: a changed tls.caBundle must not roll the pod"

    assert len(domains) == (1 if cm_on else 0), f"identities span trust domains {sorted(domains)}"
    td = values_get(values, "tls.trustDomain", "")
    if td and cm_on:
        assert domains == {td}, f"trust domain {domains}, want {td}"

    # The reward and environment servers: each one's certificate and key
    # (flags when tlsArgs, env always) are files of its own Secret, mounted
    # read-only and whole; its DNS names cover the host the actors dial.
    cfg = config_of(configmaps)
    endpoints = {
        "reward": lambda: cfg["reward"]["endpoint"],
        "env": lambda: cfg["actor"]["env"]["endpoint"],
    }
    for comp in USER_SERVERS:
        if not server_on(values, comp):
            continue
        sw = server_workload(docs, comp)
        spec = sw["spec"]["template"]["spec"]
        c = spec["containers"][0]
        args, env = c.get("args", []), env_of(c)
        vols = {v["name"]: v for v in spec["volumes"]}
        files = {"--tls-cert": env.get("BAPO_TLS_CERT"), "--tls-key": env.get("BAPO_TLS_KEY")}
        if values_get(values, f"{comp}.tlsArgs", True):
            for f in files:
                assert flag(args, f) == files[f], f"{comp}: {f} {flag(args, f)} and env say different files"
        used = set()
        for f, path in files.items():
            assert path, f"{comp}: no file for {f} (env BAPO_TLS_*)"
            m = inside_mount(c, path, f"{comp} {f}")
            vol = vols[m["name"]]
            used.add(m["name"])
            assert "secret" in vol and not vol["secret"].get("items"), f"{comp}: {f} {path} must come from a Secret, whole"
            name = vol["secret"]["secretName"]
            mounted_secrets.add(name)
            if cm_on:
                assert by_secret.get(name) is leaf_by_comp.get(comp), f"{comp}: mounts Secret {name}, not its Certificate's"
            else:
                assert name == existing.get(comp), f"{comp}: mounts Secret {name}, not tls.existingSecrets.{comp} ({existing.get(comp)!r})"
            assert path.rpartition("/")[2] == FLAG_FILE[f], f"{comp}: {f} {path}: the Secret has {FLAG_FILE[f]}"
            mode = vol["secret"].get("defaultMode", 0o644)
            if mode & 0o004 == 0:
                assert spec["securityContext"].get("fsGroup") is not None, f"{comp}: Secret mode {oct(mode)} without fsGroup: the server cannot read its key"
        assert len(used) == 1, f"{comp}: certificate and key from different volumes"
        endpoint = endpoints[comp]()
        if cm_on:
            rc = leaf_by_comp[comp]
            names = set(rc["spec"].get("dnsNames", []))
            assert host_of(endpoint) in names, f"{comp} certificate lacks {host_of(endpoint)}, which the actors dial (endpoint {endpoint}); it has {sorted(names)}"
            svc = host_of(endpoint).split(".")[0]
            cd = values_get(values, "tls.clusterDomain", "cluster.local")
            forms = {svc, f"{svc}.{NAMESPACE}", f"{svc}.{NAMESPACE}.svc", f"{svc}.{NAMESPACE}.svc.{cd}"}
            forms |= set(values_get(values, f"tls.extraDnsNames.{comp}", []) or [])
            assert forms <= names, f"{comp} certificate lacks {sorted(forms - names)}"

    # Every Certificate's Secret is mounted by its component (admin: by no one).
    for comp, c in leaf_by_comp.items():
        if comp != "admin":
            assert c["spec"]["secretName"] in mounted_secrets, f"Certificate {c['metadata']['name']}: its Secret is mounted by no pod"

    # The servers' DNS names cover the hosts clients dial.
    dials = [
        ("learner", "--buffer", "buffer"),
        ("actor", "--buffer", "buffer"),
        ("actor", "--learner", "learner"),
    ]
    for client, f, server in dials:
        url = flag(args_of(comps[client]), f)
        assert url.startswith("https://"), f"{client}: {f} {url} should say https under mutual TLS"
        if cm_on:
            names = leaf_by_comp[server]["spec"].get("dnsNames", [])
            assert host_of(url) in names, f"{server} certificate lacks {host_of(url)}, which the {client} dials ({f} {url}); it has {names}"
    if cm_on:
        svc = {"buffer": comps["buffer"]["metadata"]["name"], "learner": comps["learner"]["metadata"]["name"]}
        cd = values_get(values, "tls.clusterDomain", "cluster.local")
        for server, name in svc.items():
            names = set(leaf_by_comp[server]["spec"]["dnsNames"])
            forms = {name, f"{name}.{NAMESPACE}", f"{name}.{NAMESPACE}.svc", f"{name}.{NAMESPACE}.svc.{cd}"}
            forms |= set(values_get(values, f"tls.extraDnsNames.{server}", []) or [])
            assert forms <= names, f"{server} certificate lacks {sorted(forms - names)}"
    else:
        note("existing Secrets: their SAN URIs, usages and DNS names are not in the chart and cannot be checked here")


def values_get(values: dict, dotted: str, default: Any) -> Any:
    cur: Any = values
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur:
            return default
        cur = cur[part]
    return cur


def check_tls_default() -> None:
    """The defaults: cert-manager certificates for all three, no --insecure."""
    docs = render({})
    assert tls_on({}), "tls_on({})"
    for w in workloads(docs):
        args = args_of(w)
        assert "--insecure" not in args, f"{w['metadata']['name']}: --insecure under the default values"
        assert all(f in args for f in FLAG_FILE), f"{w['metadata']['name']}: TLS flags missing"
    assert len(by_kind(docs, "Certificate")) == 4, "default: CA + buffer, learner, actor Certificates"


def check_reward_override_and_roll(rw: dict) -> None:
    """configOverride plus reward.enabled: the chart's [reward] table is
    appended and the file parses; turning the reward server on or off
    changes the actors' config checksum, so they roll."""
    override = "[buffer]\ngroup_size = 4\n\n[model]\npreset = \"tiny\"\n"
    docs = render({"reward": rw, "configOverride": override})
    cms = {c["metadata"]["name"]: c for c in by_kind(docs, "ConfigMap")}
    cfg = config_of(cms)
    assert cfg["buffer"] == {"group_size": 4} and cfg["reward"]["endpoint"].startswith("grpcs://"), f"config: {cfg}"

    def checksum(v: dict) -> str:
        a = one(render(v), "Deployment", "-actor")
        return a["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    off, on = checksum({}), checksum({"reward": rw})
    assert off != on, "enabling reward must change the actors' checksum/config"
    assert checksum({"reward": {**rw, "timeoutMs": 1234}}) != on, "a reward tuning change must roll the actors"


def check_env_override_and_roll(ev: dict) -> None:
    """configOverride plus env.enabled: the chart's [actor.env] table is
    appended (after the file's own [actor], whose keys stay) and the file
    parses; turning the environment server on or off, or its tuning,
    changes the actors' config checksum, so they roll."""
    override = "[buffer]\ngroup_size = 4\n\n[actor]\ngroup_size = 4\n\n[model]\npreset = \"tiny\"\n\n[reward]\ntimeout_ms = 1000\n"
    docs = render({"env": ev, "configOverride": override})
    cms = {c["metadata"]["name"]: c for c in by_kind(docs, "ConfigMap")}
    cfg = config_of(cms)
    assert cfg["buffer"] == {"group_size": 4} and cfg["actor"]["group_size"] == 4, f"config: {cfg}"
    assert cfg["actor"]["env"]["endpoint"].startswith("grpcs://") and cfg["actor"]["env"]["kind"] == "grpc", f"config: {cfg}"
    assert cfg["reward"] == {"timeout_ms": 1000}, "a [reward] table without an endpoint stays (the built-in one)"

    def checksum(v: dict) -> str:
        a = one(render(v), "Deployment", "-actor")
        return a["spec"]["template"]["metadata"]["annotations"]["checksum/config"]

    off, on = checksum({}), checksum({"env": ev})
    assert off != on, "enabling env must change the actors' checksum/config"
    assert checksum({"env": {**ev, "maxTurns": 7}}) != on, "an env tuning change must roll the actors"


def check_env_existing_secrets(ev: dict) -> None:
    """The environment server with certificates from Secrets you made: it
    mounts tls.existingSecrets.env, and everything fits."""
    v = {
        "env": ev,
        "tls": {
            "certManager": {"enabled": False},
            "existingSecrets": {"buffer": "b", "learner": "l", "actor": "a", "env": "bapo-env-tls"},
        },
    }
    docs = render(v)
    validate_schemas(docs)
    check_objects(docs, v)
    check_tls(docs, v)


def must_fail(values: dict, needle: str) -> None:
    try:
        render(values)
    except Exception as e:  # noqa: BLE001
        assert needle in str(e), f"failed, but not with {needle!r}: {e}"
        return
    raise AssertionError(f"rendered, but should have failed with {needle!r}")


# ------------------------------------------------------------ static files


def check_copies() -> None:
    pairs = [
        (DEPLOY / "grafana" / "bapo-dashboard.json", CHART / "dashboards" / "bapo-dashboard.json"),
        (DEPLOY / "prometheus" / "rules.yml", CHART / "prometheus" / "rules.yml"),
    ]
    assert VLLM_EXT.is_file(), f"{VLLM_EXT.relative_to(ROOT)} is missing: the chart's copy {VLLM_EXT_CHART.relative_to(ROOT)} has no source"
    pairs.append((VLLM_EXT, VLLM_EXT_CHART))
    for a, b in pairs:
        assert b.is_file(), f"{b.relative_to(ROOT)} is missing: cp {a.relative_to(ROOT)} {b.relative_to(ROOT)}"
        assert a.read_bytes() == b.read_bytes(), (
            f"{b.relative_to(ROOT)} differs from {a.relative_to(ROOT)}: copy it (cp {a.relative_to(ROOT)} {b.relative_to(ROOT)})"
        )


def dashboard_exprs(out: Path) -> int:
    """Checks the dashboard's shape and writes its queries, with Grafana's
    variables replaced, as recording rules for `promtool check rules`."""
    dash = json.loads((DEPLOY / "grafana" / "bapo-dashboard.json").read_text())
    assert dash.get("uid") and dash.get("title"), "uid and title"
    panels = []
    for p in dash["panels"]:
        panels.append(p)
        panels.extend(p.get("panels", []))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids {ids}"
    exprs = []
    for p in panels:
        if p.get("type") == "row":
            continue
        assert p.get("gridPos"), f"panel {p['id']}: gridPos"
        assert p.get("targets"), f"panel {p.get('title')}: no queries"
        assert p.get("datasource", {}).get("uid") == "${datasource}", f"panel {p.get('title')}: datasource"
        for t in p["targets"]:
            exprs.append((p["title"], t["expr"]))
    subst = {
        "$__rate_interval": "1m",
        "$__interval": "30s",
        "$__range": "1h",
        "${namespace}": "ns",
        "$namespace": "ns",
        "${release}": "rel",
        "$release": "rel",
    }
    rules = []
    for i, (title, e) in enumerate(exprs):
        for k, v in subst.items():
            e = e.replace(k, v)
        assert "$" not in e, f"{title}: unknown variable in {e}"
        rules.append({"record": f"dashboard:query_{i}", "expr": e})
    out.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, sort_keys=False))
    return len(exprs)


def alerts_tested() -> None:
    """Every alert of rules.yml has a test where it fires and one where it
    does not."""
    rules = yaml.safe_load((DEPLOY / "prometheus" / "rules.yml").read_text())
    tests = yaml.safe_load((DEPLOY / "prometheus" / "rules_test.yml").read_text())
    alerts = {r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r}
    fires, quiet = set(), set()
    for t in tests["tests"]:
        for a in t.get("alert_rule_test", []):
            (fires if a.get("exp_alerts") else quiet).add(a["alertname"])
    missing = sorted((alerts - fires) | (alerts - quiet))
    assert not missing, f"alerts without a firing and a silent test in rules_test.yml: {missing}"
    unknown = sorted((fires | quiet) - alerts)
    assert not unknown, f"rules_test.yml tests alerts rules.yml lacks: {unknown}"


def scale_query_test(docs: list[dict], out: Path) -> None:
    """Writes a promtool test of the KEDA trigger's query as rendered:
    targetReadyGroups / backlog, 1 without data, other series ignored."""
    so = by_kind(docs, "ScaledObject")[0]
    query = so["spec"]["triggers"][0]["metadata"]["query"]
    buf = one(docs, "StatefulSet", "-buffer")["metadata"]["name"]
    target = float(re.match(r"\((\d+(?:\.\d+)?) / ", query).group(1))
    lab = f'namespace="{NAMESPACE}", pod="{buf}-0"'
    series = [
        {"series": f"bapo_buffer_groups{{{lab}, state=\"ready\"}}", "values": "4x10 32x10 0x10"},
        {"series": f"bapo_buffer_groups{{{lab}, state=\"pending\"}}", "values": "100x30"},
        {"series": f"bapo_buffer_groups{{namespace=\"other\", pod=\"{buf}-0\", state=\"ready\"}}", "values": "1000x30"},
    ]
    expect = [("8m", target / 4), ("18m", target / 32), ("28m", target)]
    test = {
        "rule_files": ["empty-rules.yml"],
        "evaluation_interval": "1m",
        "tests": [
            {
                "name": "KEDA query: targetReadyGroups / backlog",
                "interval": "1m",
                "input_series": series,
                "promql_expr_test": [
                    {"expr": query, "eval_time": t, "exp_samples": [{"labels": "{}", "value": v}]} for t, v in expect
                ],
            },
            {
                "name": "KEDA query: no data means no change",
                "interval": "1m",
                "input_series": series[2:],
                "promql_expr_test": [{"expr": query, "eval_time": "5m", "exp_samples": [{"labels": "{}", "value": 1}]}],
            },
        ],
    }
    (out / "empty-rules.yml").write_text("groups: []\n")
    (out / "scale-query-test.yml").write_text(yaml.safe_dump(test, sort_keys=False))


def metric_names_documented() -> None:
    """A warning, not a failure: metrics the deploy files use that
    docs/metrics.md does not list yet."""
    documented = set(re.findall(r"`(bapo_\w+)`", (ROOT / "docs" / "metrics.md").read_text()))
    used = set()
    for f in [DEPLOY / "prometheus" / "rules.yml", DEPLOY / "grafana" / "bapo-dashboard.json"]:
        used |= set(re.findall(r"(?<![:\w])(bapo_[a-z_]+?)(?:_bucket|_sum|_count)?(?![:\w])", f.read_text()))
    missing = sorted(u for u in used if u not in documented)
    if missing:
        note("metrics used in deploy/ but not (yet) in docs/metrics.md: " + ", ".join(missing))


# -------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True, help="directory for rendered manifests")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    cases: list[tuple[str, dict]] = [("default values", {})]
    for f in sorted(CI_VALUES.glob("*.yaml")):
        cases.append((f"ci/{f.name}", yaml.safe_load(f.read_text()) or {}))
    for label, values in cases:
        docs = check(f"helm template ({label})", lambda: render(values))
        if docs is None:
            continue
        kinds = sorted({d["kind"] for d in docs})
        note(f"{label}: {len(docs)} objects: {', '.join(kinds)}")
        stem = "default" if label == "default values" else Path(label).stem
        (args.out / f"{stem}.yaml").write_text(yaml.safe_dump_all([strip(d) for d in docs], sort_keys=False))
        check(f"helm lint --strict ({label})", lambda: lint(values))
        check(f"schemas k8s {'+'.join(KUBE_VERSIONS)} strict ({label})", lambda: validate_schemas(docs))
        check(f"objects fit together ({label})", lambda: check_objects(docs, values))
        check(f"mutual TLS fits together ({label})", lambda: check_tls(docs, values))
        if by_kind(docs, "ScaledObject"):
            check(f"KEDA query test written ({label})", lambda: scale_query_test(docs, args.out))
    check("release named bapo renders", lambda: render({}, release="bapo"))

    check(
        "refuses group_size mismatch",
        lambda: must_fail({"config": {"actor": {"group_size": 4}}}, "group_size"),
    )
    check(
        "refuses unknown autoscaling provider",
        lambda: must_fail({"actor": {"autoscaling": {"enabled": True, "provider": "x"}}}, "provider"),
    )
    check(
        "refuses a misspelt value (values.schema.json)",
        lambda: must_fail({"actors": {"replicas": 2}}, "actors"),
    )
    check(
        "default values run mutual TLS, no --insecure anywhere",
        lambda: check_tls_default(),
    )
    check(
        "refuses insecure with tls.enabled (the default)",
        lambda: must_fail({"insecure": True}, "insecure: true and tls.enabled: true contradict"),
    )
    check(
        "refuses insecure with tls.enabled set",
        lambda: must_fail({"insecure": True, "tls": {"enabled": True}}, "insecure: true and tls.enabled: true contradict"),
    )
    check(
        "refuses tls.enabled=false without insecure",
        lambda: must_fail({"tls": {"enabled": False}}, "tls.enabled: false needs insecure: true"),
    )
    check(
        "refuses existing Secrets path without a Secret",
        lambda: must_fail(
            {"tls": {"certManager": {"enabled": False}, "existingSecrets": {"buffer": "b", "learner": "l"}}},
            "tls.existingSecrets.actor is required",
        ),
    )
    check(
        "refuses existing Secrets together with cert-manager",
        lambda: must_fail({"tls": {"existingSecrets": {"buffer": "b"}}}, "pick one path"),
    )
    check(
        "refuses a blocklist entry that is no SPIFFE ID",
        lambda: must_fail({"tls": {"blocklist": ["actor-3"]}}, "blocklist"),
    )
    rw_img = {"enabled": True, "image": {"repository": "registry.example.invalid/reward", "tag": "1"}}
    check(
        "refuses reward without an image",
        lambda: must_fail({"reward": {"enabled": True}}, "reward.image.repository is required"),
    )
    check(
        "refuses reward without an image tag",
        lambda: must_fail({"reward": {"enabled": True, "image": {"repository": "r"}}}, "reward.image.tag is required"),
    )
    check(
        "refuses reward with existing Secrets but no reward Secret",
        lambda: must_fail(
            {
                "reward": rw_img,
                "tls": {"certManager": {"enabled": False}, "existingSecrets": {"buffer": "b", "learner": "l", "actor": "a"}},
            },
            "tls.existingSecrets.reward is required",
        ),
    )
    check(
        "refuses config.reward while the chart writes [reward]",
        lambda: must_fail({"reward": rw_img, "config": {"reward": {"endpoint": "builtin"}}}, "config.reward is set"),
    )
    check(
        "refuses a [reward] table in configOverride while the chart writes one",
        lambda: must_fail({"reward": rw_img, "configOverride": "[model]\npreset = \"tiny\"\n\n[reward]\nendpoint = \"builtin\"\n"}, "configOverride has a [reward] table"),
    )
    check(
        "refuses a format bonus with a reward service",
        lambda: must_fail({"reward": rw_img, "config": {"actor": {"shaping": {"format_bonus": 0.1}}}}, "format_bonus"),
    )
    check("reward: [reward] follows configOverride; the actors roll", lambda: check_reward_override_and_roll(rw_img))
    ev_img = {"enabled": True, "image": {"repository": "registry.example.invalid/env", "tag": "1"}}
    check(
        "refuses env without an image",
        lambda: must_fail({"env": {"enabled": True}}, "env.image.repository is required"),
    )
    check(
        "refuses env without an image tag",
        lambda: must_fail({"env": {"enabled": True, "image": {"repository": "r"}}}, "env.image.tag is required"),
    )
    check(
        "refuses env together with reward (the actor refuses both)",
        lambda: must_fail({"env": ev_img, "reward": rw_img}, "env.enabled and reward.enabled are both true"),
    )
    check(
        "refuses env with a config.reward endpoint",
        lambda: must_fail({"env": ev_img, "config": {"reward": {"endpoint": "grpc://judge.example:50061"}}}, "config.reward.endpoint"),
    )
    check(
        "refuses env with a [reward] endpoint in configOverride",
        lambda: must_fail(
            {"env": ev_img, "configOverride": "[model]\npreset = \"tiny\"\n\n[reward]\ntimeout_ms = 5\nendpoint = 'grpc://judge.example:50061'\n"},
            "configOverride sets [reward] endpoint",
        ),
    )
    check(
        "refuses an [actor.env] table in configOverride while the chart writes one",
        lambda: must_fail({"env": ev_img, "configOverride": "[model]\npreset = \"tiny\"\n\n[actor.env]\nkind = \"builtin\"\n"}, "configOverride has an [actor.env] table"),
    )
    check(
        "refuses config.actor.env while the chart writes [actor.env]",
        lambda: must_fail({"env": ev_img, "config": {"actor": {"env": {"kind": "builtin"}}}}, "config.actor.env is set"),
    )
    check(
        "refuses an observation cap that leaves no room for a model turn",
        lambda: must_fail({"env": {**ev_img, "maxObservationTokens": 256}}, "env.maxObservationTokens (256) must be below"),
    )
    check(
        "refuses an unknown env.truncate (values.schema.json)",
        lambda: must_fail({"env": {**ev_img, "truncate": "middle"}}, "truncate"),
    )
    check(
        "refuses env with existing Secrets but no env Secret",
        lambda: must_fail(
            {
                "env": ev_img,
                "tls": {"certManager": {"enabled": False}, "existingSecrets": {"buffer": "b", "learner": "l", "actor": "a"}},
            },
            "tls.existingSecrets.env is required",
        ),
    )
    check(
        "env: a config.reward without an endpoint renders beside it",
        lambda: check_objects(render({"env": ev_img, "config": {"reward": {"timeout_ms": 1000}}}), {"env": ev_img, "config": {"reward": {"timeout_ms": 1000}}}),
    )
    check("env: [actor.env] follows configOverride; the actors roll", lambda: check_env_override_and_roll(ev_img))
    check("env: existing Secrets render and fit", lambda: check_env_existing_secrets(ev_img))
    vl = {"model": {"hfDir": "/models/m", "volume": {"existingClaim": "models"}}, "actor": {"engine": "vllm"}}

    def vl_with(**actor: Any) -> dict:
        out = json.loads(json.dumps(vl))
        for k, val in actor.items():
            if isinstance(val, dict):
                out["actor"].setdefault(k, {}).update(val)
            else:
                out["actor"][k] = val
        return out

    check("vllm: the minimal engine values render and fit", lambda: check_objects(render(vl), vl))
    check("refuses an unknown actor.engine", lambda: must_fail({"actor": {"engine": "sglang"}}, "engine"))
    check(
        "refuses vllm without an image",
        lambda: must_fail(vl_with(vllm={"image": {"repository": ""}}), "actor.vllm.image.repository and actor.vllm.image.tag are required"),
    )
    check(
        "refuses vllm without an image tag",
        lambda: must_fail(vl_with(vllm={"image": {"tag": ""}}), "actor.vllm.image.repository and actor.vllm.image.tag are required"),
    )
    check("refuses vllm without a GPU", lambda: must_fail(vl_with(gpus=0), "needs actor.gpus >= 1"))
    check("refuses vllm with a preset model", lambda: must_fail({"actor": {"engine": "vllm"}}, "needs model.hfDir"))
    check(
        "refuses vllm without a model volume",
        lambda: must_fail({"model": {"hfDir": "/models/m"}, "actor": {"engine": "vllm"}}, "needs model.volume.existingClaim"),
    )
    check(
        "refuses vllm with the model outside its volume",
        lambda: must_fail({**vl, "model": {"hfDir": "/opt/m", "volume": {"existingClaim": "models"}}}, "must lie under model.volume.mountPath"),
    )
    check("refuses a weights directory over another mount", lambda: must_fail(vl_with(vllm={"weightsDir": "/tmp/w"}), "overlaps /tmp"))
    check("refuses the vLLM port on the metrics port", lambda: must_fail(vl_with(vllm={"port": 9100}), "metrics port"))
    check(
        "refuses vllm extraArgs that override the chart's flags",
        lambda: must_fail(vl_with(vllm={"extraArgs": ["--host=0.0.0.0"]}), "--host is set by the chart"),
    )
    check(
        "refuses configOverride with engine vllm",
        lambda: must_fail({**vl, "configOverride": "[model]\npreset = \"tiny\"\n"}, "configOverride with actor.engine vllm"),
    )
    check("refuses config.actor.engine", lambda: must_fail({"config": {"actor": {"engine": "vllm"}}}, "set the engine with actor.engine"))
    check(
        "refuses config.actor.vllm with engine burn",
        lambda: must_fail({"config": {"actor": {"vllm": {"url": "http://x"}}}}, "config.actor.vllm is set while actor.engine is burn"),
    )
    check(
        "refuses config.actor.vllm keys the chart writes",
        lambda: must_fail({**vl, "config": {"actor": {"vllm": {"weights_dir": "/w"}}}}, "config.actor.vllm.weights_dir is written by the chart"),
    )
    check("chart copies equal deploy/ files", check_copies)
    check("every alert has a firing and a silent test", alerts_tested)
    n = check("dashboard shape", lambda: dashboard_exprs(args.out / "dashboard-rules.yml"))
    if n:
        note(f"dashboard: {n} queries written for promtool")
    metric_names_documented()

    failed = [r for r in results if not r[0]]
    print(f"check_deploy.py: {len(results) - len(failed)} passed, {len(failed)} failed", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
