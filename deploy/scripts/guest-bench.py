#!/usr/bin/env python3
"""Run guests/bench (bench.wasm) under Wasmtime, with no facegate host.

Times the guest SDK's image decode and letterbox inside wasm (Cranelift, as
in the host) and, given the model, runs the whole guest `detect` pipeline
with `face-detect.infer` provided here by onnxruntime, printing the faces
to compare with the reference detections in shared/notes/model.md.

Needs: pip install wasmtime (>= 50, for components) [onnxruntime numpy]
Build first: deploy/scripts/build-guests.sh

Usage:
  guest-bench.py BENCH.wasm IMAGE_DIR [--model centerface.onnx] [BENCH ARGS...] IMAGE...
IMAGE names are relative to IMAGE_DIR; BENCH ARGS: --iterations N, --size S.
Example:
  guest-bench.py guests/target/wasm32-wasip2/release/bench.wasm \
      runtime/tests/fixtures/images --model .facegate/models/centerface.onnx \
      --iterations 20 grace_hopper.jpg astronaut.png city.jpg
"""
import sys

import wasmtime
from wasmtime import component as wc

INTERFACE = "facegate:face-detect/face-detect@0.1.0"
RUN = "wasi:cli/run@0.2.12"
OUTPUTS = ["537", "538", "539", "540"]


def make_infer(model_path):
    """face-detect.infer over onnxruntime: u8 [H,W,3] in, four f32 [C,h,w] out."""
    import numpy as np
    import onnxruntime as ort

    ort.set_default_logger_severity(3)  # no warnings about unused initializers
    session = ort.InferenceSession(model_path, providers=["CPUExecutionProvider"])

    def infer(_store, model, tensor):
        if model != "centerface":
            return wc.Variant("unknown-model", model)
        h, w, _ = tensor.shape
        hwc = np.frombuffer(tensor.data, dtype=np.uint8).reshape(h, w, 3)
        nchw = hwc.astype(np.float32).transpose(2, 0, 1)[None]
        outs = session.run(OUTPUTS, {session.get_inputs()[0].name: nchw})
        result = []
        for out in outs:
            r = wc.Record()
            r.shape = list(out.shape[1:])
            r.element = "f32"
            r.data = out[0].astype("<f4").tobytes()
            result.append(r)
        return result

    return infer


def main(argv):
    if len(argv) < 3:
        sys.exit(__doc__)
    wasm, image_dir, rest = argv[1], argv[2], argv[3:]
    model = None
    if rest[:1] == ["--model"]:
        model, rest = rest[1], rest[2:]
    bench_args = (["--detect"] if model else []) + [
        a if a.startswith("--") or a.isdigit() else f"/images/{a}" for a in rest
    ]

    engine = wasmtime.Engine()
    component = wc.Component.from_file(engine, wasm)
    linker = wc.Linker(engine)
    linker.add_wasip2()
    if model:
        with linker.root() as root, root.add_instance(INTERFACE) as iface:
            iface.add_func("infer", make_infer(model))
    linker.define_unknown_imports_as_traps(component)

    store = wasmtime.Store(engine)
    wasi = wasmtime.WasiConfig()
    wasi.argv = ["bench"] + bench_args
    wasi.inherit_stdout()
    wasi.inherit_stderr()
    wasi.preopen_dir(image_dir, "/images")
    store.set_wasi(wasi)

    instance = linker.instantiate(store, component)
    run_iface = instance.get_export_index(store, RUN)
    run = instance.get_func(store, instance.get_export_index(store, "run", run_iface))
    result = run(store)
    run.post_return(store)
    sys.exit(0 if result is None else 1)


if __name__ == "__main__":
    main(sys.argv)
