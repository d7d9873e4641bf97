# Sourced by the call_*.sh scripts (run on the device from the repository root, with .whl/
# and .whl-extra/ carried): the carried wheels on PYTHONPATH, the machine, the bench settings.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl .whl-extra/*.whl && export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH || exit
export PYTHONUNBUFFERED=1
date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; nproc
B="--images 32 --seconds 5 --warmup 1.5 --client aiohttp --max-conns-per-proc 32 --client-procs 4"
FA="--max-batch-size 128 --max-batch-wait-ms 4 --decode-workers 8"
BIG="--max-inflight-decoded-bytes 8589934592"
NA="--max-batch-size 1 --max-batch-wait-ms 0 --gpu-decode off --decode-workers 4 --no-encoder-cuda-graphs"
