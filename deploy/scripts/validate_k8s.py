#!/usr/bin/env python3
"""Validate facegate's Kubernetes manifests (deploy/k8s); run by validate-k8s.sh.

For every kustomization under ROOT (the directories holding a
kustomization.yaml) the rendered output is validated; every other YAML file
must be either a resource or patch that some kustomization uses, or an
example (`*.example.yaml`), which is validated on its own.

Rendering: with `--kustomize CMD` (e.g. "kubectl kustomize") the command
renders, and a small built-in renderer renders too; the two must agree (so
the built-in one, used where no kubectl is installed, is known to be right
for these files). The built-in renderer handles only what these files use:
`resources` (files and directories), `components` (directories holding a
`kind: Component`), `images`, and `patches` given by `path` (strategic
merge: maps merged, lists of named maps merged by name, other lists
replaced); anything else is refused, not skipped. A component directory is
rendered alone (both renderers must agree) and cross-checked applied to
ROOT's kustomization.

Checks, each a failure:
  - every document against the Kubernetes JSON schema of each
    `--k8s-version`, in strict mode (unknown fields refused), with the
    schemas bundled in the `kubernetes-validate` package (offline); a
    kind/apiVersion with no schema is an error (the package's CLI only
    warns);
  - cross references the schema cannot see: selectors (a NetworkPolicy's
    podSelector too) match the pod labels, named ports and volumes exist,
    Secret keys exist in the example Secret, $(VAR) references are defined
    earlier, the HPA targets the Deployment;
  - the pod's hardening (non-root, read-only root, no privilege escalation,
    all capabilities dropped, seccomp RuntimeDefault), probes on /healthz
    and /readyz, a grace period longer than the preStop sleep;
  - GPU consistency: a container asking for `nvidia.com/gpu` runs
    FACEGATE_DEVICES=cuda:N/tensorrt:N and vice versa; each `--gpu-overlay`
    directory renders at least one such container.

Usage: validate_k8s.py [--k8s-version V]... [--kustomize CMD]
                       [--gpu-overlay DIR]... ROOT
"""
import argparse
import copy
import json
import os
import shlex
import subprocess
import sys

import yaml
from kubernetes_validate import utils as kv

KUSTOMIZATION_NAMES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
POD_TEMPLATE_KINDS = ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job")
GPU_RESOURCE = "nvidia.com/gpu"


class Failure(Exception):
    """A check failed; the message says which and where."""


def load_docs(path):
    with open(path, encoding="utf-8") as f:
        try:
            return [d for d in yaml.safe_load_all(f) if d is not None]
        except yaml.YAMLError as e:
            raise Failure(f"{path}: not valid YAML: {e}") from e


def rel(path):
    return os.path.relpath(path)


# --- the built-in kustomize subset -------------------------------------------

def kustomization_file(directory):
    for name in KUSTOMIZATION_NAMES:
        p = os.path.join(directory, name)
        if os.path.isfile(p):
            return p
    return None


def smp_merge(orig, patch, where):
    """Strategic merge patch, the subset these manifests need."""
    if isinstance(patch, dict) and isinstance(orig, dict):
        out = dict(orig)
        for key, value in patch.items():
            if isinstance(key, str) and key.startswith("$"):
                raise Failure(f"{where}: patch directive {key} is not supported by the built-in renderer")
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = smp_merge(out[key], value, f"{where}.{key}")
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(patch, list) and isinstance(orig, list):
        named = lambda items: items and all(isinstance(i, dict) and "name" in i for i in items)  # noqa: E731
        if named(patch) and (not orig or named(orig)):
            out = [copy.deepcopy(i) for i in orig]
            for item in patch:
                for idx, existing in enumerate(out):
                    if existing["name"] == item["name"]:
                        out[idx] = smp_merge(existing, item, f"{where}[{item['name']}]")
                        break
                else:
                    out.append(copy.deepcopy(item))
            return out
    return copy.deepcopy(patch)


def split_image(image):
    """name, tag, digest of an image reference."""
    name, _, digest = image.partition("@")
    digest = digest or None
    tag = None
    slash = name.rfind("/")
    colon = name.rfind(":")
    if colon > slash:
        name, tag = name[:colon], name[colon + 1:]
    return name, tag, digest


def pod_specs(doc):
    kind = doc.get("kind")
    spec = doc.get("spec") or {}
    if kind == "Pod":
        return [spec]
    if kind in POD_TEMPLATE_KINDS:
        return [((spec.get("template") or {}).get("spec")) or {}]
    if kind == "CronJob":
        return [(((spec.get("jobTemplate") or {}).get("spec") or {}).get("template") or {}).get("spec") or {}]
    return []


def containers(pod_spec):
    return list(pod_spec.get("initContainers") or []) + list(pod_spec.get("containers") or [])


def set_images(docs, images, where):
    for entry in images:
        unknown = set(entry) - {"name", "newName", "newTag", "digest"}
        if unknown:
            raise Failure(f"{where}: images fields {sorted(unknown)} not supported by the built-in renderer")
        for doc in docs:
            for spec in pod_specs(doc):
                for c in containers(spec):
                    name, tag, digest = split_image(c.get("image", ""))
                    if name != entry["name"]:
                        continue
                    name = entry.get("newName", name)
                    if "digest" in entry:
                        tag, digest = None, entry["digest"]
                    elif "newTag" in entry:
                        tag, digest = entry["newTag"], None
                    c["image"] = name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")


def resource_key(doc):
    group = doc.get("apiVersion", "").rpartition("/")[0]
    meta = doc.get("metadata") or {}
    return (group, doc.get("kind"), meta.get("namespace"), meta.get("name"))


def is_component(directory):
    """Whether DIRECTORY's kustomization is a `kind: Component`."""
    kfile = kustomization_file(directory)
    (k,) = (load_docs(kfile) if kfile else None) or [{}]
    return k.get("kind") == "Component"


def render_builtin(directory, used, stack=(), accumulated=()):
    """Renders the kustomization in DIRECTORY; adds the files it reads to USED.

    ACCUMULATED: the resources of the kustomization a Component is applied
    to (it adds its own, then patches and sets images over them all)."""
    directory = os.path.abspath(directory)
    if directory in stack:
        raise Failure(f"{rel(directory)}: kustomization cycle")
    kfile = kustomization_file(directory)
    if kfile is None:
        raise Failure(f"{rel(directory)}: no kustomization.yaml")
    used.add(kfile)
    (k,) = load_docs(kfile) or [{}]
    supported = {"apiVersion", "kind", "resources", "components", "images", "patches"}
    unknown = set(k) - supported
    if unknown:
        raise Failure(f"{rel(kfile)}: fields {sorted(unknown)} are not supported by the built-in "
                      "renderer: install kubectl (or kustomize), or extend deploy/scripts/validate_k8s.py")
    docs = list(accumulated)
    for entry in k.get("resources") or []:
        path = os.path.normpath(os.path.join(directory, entry))
        if os.path.isdir(path):
            docs += render_builtin(path, used, stack + (directory,))
        elif os.path.isfile(path):
            used.add(path)
            docs += load_docs(path)
        else:
            raise Failure(f"{rel(kfile)}: resource {entry} does not exist")
    # As kustomize: components apply after the resources, before this
    # kustomization's own patches and images.
    for entry in k.get("components") or []:
        path = os.path.normpath(os.path.join(directory, entry))
        if not is_component(path):
            raise Failure(f"{rel(kfile)}: component {entry} is no directory with a `kind: Component` kustomization")
        docs = render_builtin(path, used, stack + (directory,), docs)
    keys = [resource_key(d) for d in docs]
    for key in keys:
        if keys.count(key) > 1:
            raise Failure(f"{rel(kfile)}: resource {key} appears twice")
    for entry in k.get("patches") or []:
        if set(entry) != {"path"}:
            raise Failure(f"{rel(kfile)}: only `patches: - path: FILE` is supported by the built-in renderer")
        path = os.path.normpath(os.path.join(directory, entry["path"]))
        used.add(path)
        for patch in load_docs(path):
            key = resource_key(patch)
            try:
                i = keys.index(key)
            except ValueError:
                raise Failure(f"{rel(path)}: patch target {key} is not among the resources") from None
            docs[i] = smp_merge(docs[i], patch, rel(path))
    set_images(docs, k.get("images") or [], rel(kfile))
    return docs


def render_command(command, directory):
    argv = shlex.split(command) + [directory]
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise Failure(f"`{' '.join(argv)}` failed:\n{proc.stderr.strip()}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d is not None]


def normalized(docs):
    """Order-insensitive form for comparing two renders (named lists sorted by name)."""
    def norm(value):
        if isinstance(value, dict):
            return {k: norm(v) for k, v in value.items()}
        if isinstance(value, list):
            items = [norm(v) for v in value]
            if items and all(isinstance(i, dict) and "name" in i for i in items):
                items.sort(key=lambda i: str(i["name"]))
            return items
        return value
    return sorted((json.dumps(norm(d), sort_keys=True) for d in docs))


# --- checks ------------------------------------------------------------------

def schema_errors(doc, source, versions):
    errors = []
    name = f"{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"
    for version in versions:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            path = ".".join(str(p) for p in e.path) or "(top)"
            errors.append(f"{source}: {name}: schema {e.version} (strict): {path}: {e.message}")
        except kv.SchemaNotFoundError as e:
            errors.append(f"{source}: {name}: {e.message}")
        except kv.VersionNotSupportedError as e:
            raise Failure(f"kubernetes-validate has no schemas for Kubernetes {e.version}") from e
        except (KeyError, TypeError) as e:
            errors.append(f"{source}: document without apiVersion/kind ({e})")
    return errors


def matches(selector, labels):
    if not selector:
        return False
    if "matchExpressions" in selector:
        raise Failure("matchExpressions selectors are not checked; extend validate_k8s.py")
    wanted = selector.get("matchLabels", selector)
    return all(labels.get(k) == v for k, v in wanted.items())


def cross_check(docs, source, secrets, gpu_expected):
    errors = []
    err = lambda msg: errors.append(f"{source}: {msg}")  # noqa: E731
    by_kind = {}
    for d in docs:
        by_kind.setdefault(d.get("kind"), []).append(d)
    pod_labels = []  # (deployment name, template labels)
    gpu_containers = 0
    for dep in by_kind.get("Deployment", []):
        dname = f"Deployment/{dep['metadata']['name']}"
        spec = dep["spec"]
        tmpl = spec["template"]
        labels = (tmpl.get("metadata") or {}).get("labels") or {}
        pod_labels.append((dep["metadata"]["name"], labels))
        if not matches(spec.get("selector"), labels):
            err(f"{dname}: spec.selector does not match the pod template's labels")
        pod = tmpl["spec"]
        psc = pod.get("securityContext") or {}
        volumes = {v["name"] for v in pod.get("volumes") or []}
        for tsc in pod.get("topologySpreadConstraints") or []:
            if not matches(tsc.get("labelSelector"), labels):
                err(f"{dname}: a topologySpreadConstraint's labelSelector does not match the pods")
        for c in containers(pod):
            cname = f"{dname} container {c['name']}"
            csc = c.get("securityContext") or {}
            eff = lambda key: csc.get(key, psc.get(key))  # noqa: E731
            if eff("runAsNonRoot") is not True:
                err(f"{cname}: runAsNonRoot must be true")
            if csc.get("readOnlyRootFilesystem") is not True:
                err(f"{cname}: readOnlyRootFilesystem must be true")
            if csc.get("allowPrivilegeEscalation") is not False:
                err(f"{cname}: allowPrivilegeEscalation must be false")
            if "ALL" not in ((csc.get("capabilities") or {}).get("drop") or []):
                err(f"{cname}: capabilities must drop ALL")
            if (eff("seccompProfile") or {}).get("type") != "RuntimeDefault":
                err(f"{cname}: seccompProfile must be RuntimeDefault")
            ports = {p.get("name") for p in c.get("ports") or []}
            for probe, path in (("startupProbe", "/healthz"), ("livenessProbe", "/healthz"),
                                ("readinessProbe", "/readyz")):
                get = (c.get(probe) or {}).get("httpGet")
                if not get:
                    err(f"{cname}: no {probe} (httpGet {path})")
                    continue
                if get.get("path") != path:
                    err(f"{cname}: {probe} must GET {path}, not {get.get('path')}")
                if isinstance(get.get("port"), str) and get["port"] not in ports:
                    err(f"{cname}: {probe} uses port {get['port']!r}, which the container does not name")
            for m in c.get("volumeMounts") or []:
                if m["name"] not in volumes:
                    err(f"{cname}: volumeMount {m['name']!r} has no volume")
            defined = set()
            env = {}
            for e in c.get("env") or []:
                value = e.get("value") or ""
                start = 0
                while (i := value.find("$(", start)) >= 0:
                    j = value.find(")", i)
                    var = value[i + 2:j]
                    if var not in defined:
                        err(f"{cname}: env {e['name']} refers to $({var}), not defined before it")
                    start = j + 1
                ref = (e.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    keys = secrets.get(ref["name"])
                    if keys is None:
                        err(f"{cname}: env {e['name']} uses Secret {ref['name']!r}, which no example defines")
                    elif ref["key"] not in keys:
                        err(f"{cname}: env {e['name']} uses key {ref['key']!r}, not in Secret {ref['name']!r}")
                defined.add(e["name"])
                env[e["name"]] = value
            per_ip = env.get("FACEGATE_MAX_CONNECTIONS_PER_IP", "256")
            if not (per_ip.isdigit() and int(per_ip) > 0):
                err(f"{cname}: FACEGATE_MAX_CONNECTIONS_PER_IP must be a cap above 0, not {per_ip!r} (0 lets one address fill the listener)")
            pre = (((c.get("lifecycle") or {}).get("preStop") or {}).get("exec") or {}).get("command") or []
            sleep = int(pre[-1]) if pre and pre[0].endswith("sleep") and pre[-1].isdigit() else 0
            grace = pod.get("terminationGracePeriodSeconds", 30)
            if grace <= sleep + 10:
                err(f"{cname}: terminationGracePeriodSeconds {grace} leaves no time to drain after the {sleep} s preStop sleep")
            res = c.get("resources") or {}
            gpu = GPU_RESOURCE in (res.get("limits") or {})
            devices = [d.strip() for d in env.get("FACEGATE_DEVICES", "cpu").split(",")]
            on_gpu = any(d.startswith(("cuda:", "tensorrt:")) for d in devices)
            if gpu != on_gpu:
                err(f"{cname}: limits {GPU_RESOURCE} {'set' if gpu else 'unset'} but FACEGATE_DEVICES={','.join(devices)}")
            if GPU_RESOURCE in (res.get("requests") or {}) and not gpu:
                err(f"{cname}: {GPU_RESOURCE} requested without a limit")
            gpu_containers += gpu
    for svc in by_kind.get("Service", []):
        sel = svc["spec"].get("selector") or {}
        targets = [n for n, labels in pod_labels if all(labels.get(k) == v for k, v in sel.items())]
        if not targets:
            err(f"Service/{svc['metadata']['name']}: selector matches no Deployment's pods")
        for dep in by_kind.get("Deployment", []):
            if dep["metadata"]["name"] not in targets:
                continue
            named = {p.get("name") for c in dep["spec"]["template"]["spec"]["containers"] for p in c.get("ports") or []}
            for p in svc["spec"].get("ports") or []:
                if isinstance(p.get("targetPort"), str) and p["targetPort"] not in named:
                    err(f"Service/{svc['metadata']['name']}: targetPort {p['targetPort']!r} is no container port name")
    for pdb in by_kind.get("PodDisruptionBudget", []):
        if not any(matches(pdb["spec"].get("selector"), labels) for _, labels in pod_labels):
            err(f"PodDisruptionBudget/{pdb['metadata']['name']}: selector matches no Deployment's pods")
    for policy in by_kind.get("NetworkPolicy", []):
        if not any(matches(policy["spec"].get("podSelector"), labels) for _, labels in pod_labels):
            err(f"NetworkPolicy/{policy['metadata']['name']}: podSelector matches no Deployment's pods")
    for hpa in by_kind.get("HorizontalPodAutoscaler", []):
        ref = hpa["spec"]["scaleTargetRef"]
        if ref["kind"] != "Deployment" or ref["name"] not in [n for n, _ in pod_labels]:
            err(f"HorizontalPodAutoscaler/{hpa['metadata']['name']}: scaleTargetRef {ref['kind']}/{ref['name']} is not here")
    if gpu_expected and not gpu_containers:
        err(f"a GPU overlay, but no container has a {GPU_RESOURCE} limit (did the patch apply?)")
    return errors


# --- main --------------------------------------------------------------------

def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root")
    ap.add_argument("--k8s-version", action="append", required=True)
    ap.add_argument("--kustomize", help='command that renders a kustomization directory, e.g. "kubectl kustomize"')
    ap.add_argument("--gpu-overlay", action="append", default=[])
    args = ap.parse_args()

    root = os.path.abspath(args.root)
    yaml_files, kdirs = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for f in sorted(filenames):
            p = os.path.join(dirpath, f)
            if f in KUSTOMIZATION_NAMES:
                kdirs.append(dirpath)
            elif f.endswith((".yaml", ".yml")):
                yaml_files.append(p)
    gpu_dirs = {os.path.abspath(d) for d in args.gpu_overlay}
    for d in gpu_dirs:
        if d not in kdirs:
            raise Failure(f"--gpu-overlay {rel(d)} is no kustomization directory")

    errors = []
    used = set()
    renders = []
    for d in kdirs:
        docs = render_builtin(d, used)
        how = "built-in renderer"
        if args.kustomize:
            theirs = render_command(args.kustomize, d)
            if normalized(theirs) != normalized(docs):
                errors.append(f"{rel(d)}: `{args.kustomize}` and the built-in renderer disagree "
                              "(compare `kubectl kustomize` with validate_k8s.py's render_builtin)")
            docs, how = theirs, args.kustomize
        if is_component(d):
            # A component alone has no pods for its selectors: cross-checked
            # as applied to ROOT's kustomization (the default variant).
            docs = render_builtin(root, set(), accumulated=()) + docs
            how += f", applied to {rel(root)}"
        renders.append((d, docs, how))

    secrets = {}
    standalone = []
    for p in yaml_files:
        if p in used:
            continue
        if not p.endswith((".example.yaml", ".example.yml")):
            errors.append(f"{rel(p)}: used by no kustomization (name examples *.example.yaml)")
            continue
        docs = load_docs(p)
        standalone.append((p, docs))
        for d in docs:
            if d.get("kind") == "Secret":
                keys = set((d.get("stringData") or {})) | set((d.get("data") or {}))
                secrets[(d.get("metadata") or {}).get("name")] = keys

    checked = 0
    for d, docs, how in renders:
        source = f"{rel(d)} (rendered by {how})"
        for doc in docs:
            errors += schema_errors(doc, source, args.k8s_version)
        errors += cross_check(docs, source, secrets, d in gpu_dirs)
        kinds = ", ".join(f"{x['kind']}/{x['metadata']['name']}" for x in docs)
        print(f"  {rel(d)}: {len(docs)} resources ({kinds})")
        checked += len(docs)
    for p, docs in standalone:
        for doc in docs:
            errors += schema_errors(doc, rel(p), args.k8s_version)
        print(f"  {rel(p)}: {len(docs)} resources (example, not in a kustomization)")
        checked += len(docs)

    if errors:
        for e in errors:
            print(f"ERROR {e}", file=sys.stderr)
        print(f"validate-k8s: {len(errors)} error(s)", file=sys.stderr)
        return 1
    print(f"validate-k8s: {checked} documents valid against Kubernetes "
          f"{', '.join(args.k8s_version)} (strict schemas, kubernetes-validate {kv.__version__})")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Failure as e:
        print(f"ERROR {e}", file=sys.stderr)
        sys.exit(1)
