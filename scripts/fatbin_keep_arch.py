#!/usr/bin/env python3
"""Zero the payloads of the GPU images in a shared library's `.nv_fatbin` section whose SM
architecture is not one of KEEP (comma list, e.g. 90), in place. Every container and entry header,
size and offset stays as it was, so the library links and loads as before; the CUDA driver picks
an image by the architecture in its header, and on a GPU of a kept architecture it never reads a
zeroed one. The zeros compress to nothing, which is the point (scripts/ort-gpu-pack.sh).

    python3 scripts/fatbin_keep_arch.py LIB.so 90

Fatbin layout walked here: containers (magic 0xBA55ED50, u16 version, u16 header size, u64 size
of the entries) one after another, 8-byte aligned; in each, entries with a u16 kind (1 PTX,
2 ELF), u16 version, u32 header size, u64 payload size, and the u32 SM architecture at byte 28.
"""
import struct
import sys

FATBIN_MAGIC = 0xBA55ED50


def fatbin_section(data):
    """(offset, size) of the ELF64 section named .nv_fatbin."""
    shoff = struct.unpack_from("<Q", data, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)

    def header(i):
        return struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)

    names = header(shstrndx)[4]
    for i in range(shnum):
        h = header(i)
        start = names + h[0]
        if data[start:data.index(b"\0", start)] == b".nv_fatbin":
            return h[4], h[5]
    sys.exit("no .nv_fatbin section")


def main():
    path, keep = sys.argv[1], {int(a) for a in sys.argv[2].split(",")}
    data = bytearray(open(path, "rb").read())
    if data[:4] != b"\x7fELF" or data[4] != 2:
        sys.exit(f"{path}: not an ELF64 file")
    off, size = fatbin_section(data)
    end = off + size
    archs, kept, zeroed, zeroed_bytes = {}, 0, 0, 0
    p = off
    while p < end:
        magic, _version, header_size, entries_size = struct.unpack_from("<IHHQ", data, p)
        if magic != FATBIN_MAGIC:
            p += 8  # alignment between containers
            continue
        q, container_end = p + header_size, p + header_size + entries_size
        while q < container_end:
            kind, _v, entry_header_size, payload_size = struct.unpack_from("<HHIQ", data, q)
            arch = struct.unpack_from("<I", data, q + 28)[0]
            archs[(kind, arch)] = archs.get((kind, arch), 0) + 1
            if arch in keep:
                kept += 1
            else:
                start = q + entry_header_size
                data[start:start + payload_size] = bytes(payload_size)
                zeroed += 1
                zeroed_bytes += payload_size
            q += entry_header_size + payload_size
        p = container_end
    if kept == 0:
        sys.exit(f"{path}: no image of architecture {sorted(keep)} (entries by (kind, arch): {archs}); file unchanged")
    open(path, "wb").write(data)
    print(f"{path}: entries by (kind, arch) {dict(sorted(archs.items()))}; kept {kept}, "
          f"zeroed {zeroed} ({zeroed_bytes / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
