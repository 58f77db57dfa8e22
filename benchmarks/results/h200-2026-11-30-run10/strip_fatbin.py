"""Zero every non-sm_90 cubin in a shared library's fatbins (benchmark transport only)."""
import struct, sys, mmap
path, keep = sys.argv[1], int(sys.argv[2])
f = open(path, "r+b"); m = mmap.mmap(f.fileno(), 0)
MAGIC = struct.pack("<I", 0xBA55ED50)
pos = 0; stats = {}; zeroed = kept = 0; containers = 0
while True:
    pos = m.find(MAGIC, pos)
    if pos < 0: break
    magic, ver, hsz, fat = struct.unpack_from("<IHHQ", m, pos)
    if ver != 1 or hsz != 16 or fat <= 0 or pos + 16 + fat > len(m):
        pos += 4; continue
    containers += 1
    e = pos + 16; end = pos + 16 + fat
    while e < end:
        kind, _u, ehs, size = struct.unpack_from("<HHIQ", m, e)
        arch = struct.unpack_from("<I", m, e + 28)[0]
        if kind not in (1, 2) or ehs < 64 or e + ehs + size > end:
            print("bad entry at", hex(e), kind, ehs, size); break
        key = (kind, arch); stats[key] = stats.get(key, 0) + size
        if kind == 2 and arch != keep:
            m[e + ehs:e + ehs + size] = b"\0" * size; zeroed += size
        else:
            kept += size
        e += ehs + size
    pos = end
m.flush()
print("containers", containers, "zeroed MB", zeroed / 1e6, "kept MB", kept / 1e6)
for k, v in sorted(stats.items()): print(k, round(v / 1e6, 1))
