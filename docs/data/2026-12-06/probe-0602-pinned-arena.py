"""One-call decode of 64 photos as spans of an arena: pageable against page-locked."""
import time, torch, statistics
from skimage import data
from app.engine import Job, byte_spans
from app.gpu_decode import HostPinning, JpegDecoder
from app.job_arena import ArenaView, FrontArena
from tests.test_imaging import jpeg
dev = torch.device("cuda")
dec = JpegDecoder.create(dev, "auto", "nvjpeg")
imgs = [data.astronaut(), data.coffee(), data.chelsea(), data.rocket(), data.hubble_deep_field()]
photos = [jpeg(torch.nn.functional.interpolate(torch.from_numpy(i).permute(2,0,1)[None].float(), size=(768,1024)).clamp(0,255).byte()[0].permute(1,2,0).numpy(), quality=90) for i in imgs]
photos = (photos * 13)[:64]
print("kB/photo", sum(map(len, photos)) / len(photos) / 1e3)
for pinned in (False, True, False, True):
    arena = FrontArena(64 << 20); view = ArenaView(arena.fd, arena.size)
    ext = arena.put(photos); views = view.images(ext.offset, [len(p) for p in photos])
    jobs, at = [], ext.offset
    for v in views:
        jobs.append(Job("x", None, jpeg=v, orientation=1, arena=view, arena_offset=at)); at += len(v)
    pin = HostPinning.for_device(dev) if pinned else None
    spans = byte_spans(jobs, pin)
    print("pinned" if spans.sources[0].is_pinned() else "pageable")
    ts, cs = [], []
    for k in range(60):
        torch.cuda.synchronize()
        t, c = time.perf_counter(), time.thread_time()
        out = dec.decode_preprocess(spans, [1] * 64, 224)
        t1, c1 = time.perf_counter(), time.thread_time()
        torch.cuda.synchronize()
        if k >= 10: ts.append(t1 - t); cs.append(c1 - c)
    print(f"{'pinned' if pinned else 'pageable'}: call {1e3*statistics.median(ts):.2f} ms (cpu {1e3*statistics.median(cs):.2f}) per 64")
    del spans, jobs, views, out; view.close(); arena.close()
