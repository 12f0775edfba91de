"""NRI's API and ttrpc's envelope as protobuf messages: `api_pb2` and `ttrpc_pb2`, generated
from the .proto files beside this module when gpugate is built (setup.py's build_py, with
grpcio-tools); only `gpugate nri` imports them."""
