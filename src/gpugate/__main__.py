from gpugate.front.cli import run

run()
