"""Generated code for the ``splitserve.v1`` protos; do not edit (``python -m protos.codegen``)."""
