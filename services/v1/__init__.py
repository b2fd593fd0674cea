# Generated from protos/rlfleet/v1 by tools/gen_protos.py. Do not edit.
