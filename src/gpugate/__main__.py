from gpugate.front.entry import run

run()
