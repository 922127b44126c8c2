#!/usr/bin/env python3
"""Make CenterFace INT8 from the prepared FP32 model: ONNX Runtime's static
quantization (QOperator: QLinearConv and the like, which ONNX Runtime's CPU
kernels run in int8; weights int8 per channel, activations uint8), calibrated
on images the project ships for that purpose (scikit-image's sample images,
and a mosaic of its LFW face crops), never on the test images.

Each image is letterboxed the way the gateway's handlers feed the model
(scale to fit, top-left, zero padding, RGB 0-255, NCHW float32), at 640 and
at 320, so the activations' ranges are those the model sees when serving.

Usage: quantize_model.py PREPARED.onnx CALIBRATION_DIR INT8.onnx
"""
import os
import sys
import tempfile

import numpy as np
import onnx
import onnx.version_converter
import onnxruntime
from PIL import Image
from onnxruntime.quantization import (CalibrationDataReader, CalibrationMethod, QuantFormat, QuantType,
                                      quantize_static)
from onnxruntime.quantization.shape_inference import quant_pre_process

OPSET = 13

SIDES = (640, 320)
MOSAIC_GRID = 8


def letterbox(image, side):
    """The gateway's letterbox: fit inside side x side, top-left, zero padding."""
    scale = min(side / image.width, side / image.height)
    size = (max(1, round(image.width * scale)), max(1, round(image.height * scale)))
    canvas = np.zeros((side, side, 3), dtype=np.float32)
    canvas[:size[1], :size[0]] = np.asarray(image.convert("RGB").resize(size, Image.BILINEAR), dtype=np.float32)
    return canvas.transpose(2, 0, 1)[np.newaxis]


def lfw_mosaic(path):
    """scikit-image's 200 LFW crops (25x25 grey, 0-1), 64 of them tiled 8x8."""
    faces = np.load(path)[: MOSAIC_GRID * MOSAIC_GRID]
    rows = [np.concatenate(list(faces[r * MOSAIC_GRID:(r + 1) * MOSAIC_GRID]), axis=1) for r in range(MOSAIC_GRID)]
    grey = (np.concatenate(rows, axis=0) * 255).clip(0, 255).astype(np.uint8)
    return Image.fromarray(grey).resize((grey.shape[1] * 3, grey.shape[0] * 3), Image.BILINEAR)


def calibration_images(directory):
    names = sorted(os.listdir(directory))
    for name in names:
        path = os.path.join(directory, name)
        if name.endswith(".npy"):
            yield name, lfw_mosaic(path)
        elif name.lower().endswith((".png", ".jpg", ".jpeg")):
            yield name, Image.open(path)


class Reader(CalibrationDataReader):
    def __init__(self, input_name, directory):
        self.samples = [letterbox(image, side) for _, image in calibration_images(directory) for side in SIDES]
        if not self.samples:
            sys.exit(f"no calibration images in {directory}")
        self.input_name = input_name
        self.next = iter(self.samples)

    def get_next(self):
        sample = next(self.next, None)
        return None if sample is None else {self.input_name: sample}

    def rewind(self):
        self.next = iter(self.samples)


def upgrade_and_fold(src, scratch):
    """Opset 13 (per-channel DequantizeLinear needs its `axis`), then ONNX
    Runtime's pre-processing (batch norms folded into their convolutions,
    shapes inferred), so the quantizer sees the graph that will run."""
    model = onnx.version_converter.convert_version(onnx.load(src), OPSET)
    upgraded = os.path.join(scratch, "opset13.onnx")
    onnx.save(model, upgraded)
    folded = os.path.join(scratch, "folded.onnx")
    quant_pre_process(upgraded, folded, skip_symbolic_shape=True)
    return folded, model.graph.input[0].name


def main(src, calibration, dst):
    onnxruntime.set_default_logger_severity(3)
    with tempfile.TemporaryDirectory() as scratch:
        # The calibrator writes an augmented copy of the model; keep it out of the models directory.
        os.environ["TMPDIR"] = scratch
        folded, input_name = upgrade_and_fold(src, scratch)
        reader = Reader(input_name, calibration)
        quantize_static(
            folded,
            dst,
            reader,
            quant_format=QuantFormat.QOperator,
            per_channel=True,
            activation_type=QuantType.QUInt8,
            weight_type=QuantType.QInt8,
            calibrate_method=CalibrationMethod.MinMax,
        )
    print(f"quantized {dst}: {len(reader.samples)} calibration samples from {calibration}")


if __name__ == "__main__":
    if len(sys.argv) != 4:
        sys.exit(__doc__)
    main(*sys.argv[1:])
