#!/usr/bin/env bash
# flytekit + Ray for a GPU machine that has torch, transformers, pyarrow, grpcio and protobuf but neither of these
# and no package index, as one .tar.xz of an unpacked site directory (the two as wheels are ~100 MB; this is 30-35 MB):
# Ray without its Java jars, dashboard front end, RLlib / Serve / Data / LLM libraries (the pool uses core Ray:
# actors, placement groups, the object store), flytekit's dependency closure without the Azure / GCS file systems
# (the S3 one stays) and botocore's service models other than S3 / STS / SSO.
#
#   bash benchmarks/gpu_carry_bundle.sh OUT.tar.xz [python version, default 3.12]
#   # there:  mkdir -p /tmp/site && tar -C /tmp/site -xJf OUT.tar.xz && export PYTHONPATH=$PWD:/tmp/site
#
# Versions: the ones this repo's environment pins (the running interpreter's installed flytekit / ray / deps).
set -euo pipefail
OUTFILE="$(realpath -m "${1:?usage: gpu_carry_bundle.sh OUT.tar.xz [python version]}")"
PYV="${2:-3.12}"
PY="${PYTHON:-python3}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
# what the GPU image already has (device notes' package list): not carried
have="torch transformers peft accelerate numpy pyarrow grpcio protobuf requests urllib3 certifi idna charset-normalizer
click cloudpickle filelock fsspec msgpack packaging pyyaml rich markdown-it-py mdurl pygments typing-extensions
python-dateutil six aiohttp aiosignal frozenlist multidict yarl propcache aiohappyeyeballs attrs aiofiles joblib
psutil xxhash safetensors huggingface-hub hf-xet tokenizers tqdm jinja2 markupsafe pillow regex prometheus-client
wrapt zipp mypy-extensions typing-inspect setuptools pip wheel"
"$PY" - "$have" > "$work/reqs.txt" <<'PY'
import importlib.metadata as md, re, sys
norm = lambda s: re.sub(r"[-_.]+", "-", s).lower()
have = set(sys.argv[1].split())
skip = {"pywin32", "dataclasses", "adlfs", "gcsfs", "azure-identity", "azure-storage-blob", "azure-core", "msal",
        "msal-extensions", "google-cloud-storage", "google-cloud-storage-control", "google-resumable-media",
        "google-crc32c", "google-cloud-core"}
# decorator: flytekit imports it but has it only through gcsfs, which is left out
seen, todo = {}, ["flytekit", "flytekitplugins-kfpytorch", "ray", "decorator"]
while todo:
    n = norm(todo.pop())
    if n in seen or n in have or n in skip:
        continue
    seen[n] = md.distribution(n).version
    for r in md.distribution(n).requires or []:
        if "extra ==" in r or ('sys_platform == "win32"' in r) or ('platform_system == "Windows"' in r):
            continue
        todo.append(re.match(r"[A-Za-z0-9_.\-]+", r).group(0))
print("\n".join(f"{k}=={v}" for k, v in sorted(seen.items())))
PY
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$work/whl" -r "$work/reqs.txt"
mkdir "$work/site"
"$PY" - "$work" <<'PY'
import glob, os, shutil, sys, zipfile
work = sys.argv[1]
site = os.path.join(work, "site")
for w in glob.glob(os.path.join(work, "whl", "*.whl")):
    with zipfile.ZipFile(w) as z:
        for info in z.infolist():
            path = z.extract(info, site)
            mode = info.external_attr >> 16  # extractall drops it: Ray's gcs_server / raylet must stay executable
            if mode & 0o111 and not info.is_dir():
                os.chmod(path, mode & 0o777)
for d in glob.glob(os.path.join(site, "*.data")):  # a wheel's purelib / platlib go beside the packages
    for sub in ("purelib", "platlib"):
        for n in os.listdir(p) if os.path.isdir(p := os.path.join(d, sub)) else []:
            shutil.move(os.path.join(p, n), os.path.join(site, n))
    shutil.rmtree(d)
PY
cd "$work/site"
rm -rf ray/jars ray/rllib ray/serve ray/llm ray/data ray/dashboard/client/build
find botocore/data -mindepth 1 -maxdepth 1 -type d ! -name s3 ! -name sts ! -name sso ! -name sso-oidc -exec rm -rf {} +
find . -name '*.js.map' -delete
tar -cJf "$OUTFILE" .
ls -la "$OUTFILE"
