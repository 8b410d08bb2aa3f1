"""Generated gRPC stubs (scripts/gen_protos.sh); do not edit."""
