#!/usr/bin/env python3
"""Copy ONNX Runtime's GPU libraries out of an onnxruntime-gpu wheel.

Usage: extract-onnxruntime-gpu.py WHEEL DEST_DIR

Copies libonnxruntime.so.<version>, libonnxruntime_providers_shared.so and
libonnxruntime_providers_cuda.so (not TensorRT's provider: the image has no
TensorRT) into DEST_DIR and links libonnxruntime.so to the first. Fails if
the wheel does not hold exactly those. Used by deploy/docker/Dockerfile.
"""
import os
import re
import shutil
import sys
import zipfile

WANTED = re.compile(r"onnxruntime/capi/(libonnxruntime\.so\.[0-9.]+|libonnxruntime_providers_(?:shared|cuda)\.so)$")


def main(wheel, dest):
    found = []
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            m = WANTED.match(name)
            if m:
                with z.open(name) as src, open(os.path.join(dest, m.group(1)), "wb") as dst:
                    shutil.copyfileobj(src, dst)
                found.append(m.group(1))
    main_lib = [f for f in found if f.startswith("libonnxruntime.so.")]
    if len(main_lib) != 1 or len(found) != 3:
        sys.exit(f"unexpected onnxruntime-gpu wheel contents: {sorted(found)}")
    link = os.path.join(dest, "libonnxruntime.so")
    if os.path.lexists(link):
        os.remove(link)
    os.symlink(main_lib[0], link)
    print("onnxruntime-gpu:", ", ".join(sorted(found)))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
