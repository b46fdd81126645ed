"""RESULTS 2026-12-06 (p): a toy model of the deterministic causal backward's schedule (not a GPU measurement).

1 block per SM (132), B2 H8 heads, causal, key blocks of 128 over query blocks of 64 (key block n visits query
blocks 2n .. M-1), a pair per time unit, two sDqAcc buffers (a dQ warp each), an add taking r after its turn.
Prints the grid's ideal time over its modelled time for main's order (launched longest first, query blocks
last to first, turns from key block 0 up) and FlashAttention-3's (shortest first, query blocks first to last,
turns from the diagonal's key block down)."""
import heapq


def model(M, NB, heads, sms, r, order, visit, turns):
    length = lambda n: M - 2 * n
    blocks = sorted(((h, n) for h in range(heads) for n in range(NB)),
                    key=lambda b: (-length(b[1]) if order == "lpt" else length(b[1]), b[0]))
    done = {}  # (head, query block, key block) -> when its add landed
    free = [0.0] * sms
    finish = 0.0
    for h, n in blocks:  # each waits only on blocks launched before it
        t0 = heapq.heappop(free)
        tiles = list(range(2 * n, M))[::-1 if visit == "desc" else 1]
        end, warp = t0, [t0, t0]
        for i, m in enumerate(tiles):
            b = i & 1
            end = max(end, warp[b]) + 1  # the consumers need buffer b back
            prev = n - 1 if turns == "asc" else (n + 1 if n + 1 <= m // 2 else -1)
            turn = done[(h, m, prev)] if prev >= 0 else 0.0
            warp[b] = done[(h, m, n)] = max(end, turn, warp[b]) + r
        t_end = max(end, *warp)
        heapq.heappush(free, t_end)
        finish = max(finish, t_end)
    return heads * sum(length(n) for n in range(NB)) / sms / finish


for N in (4096, 16384):
    for r in (0.1, 0.3, 0.6):
        print(N, r, {name: round(model(N // 64, N // 128, 16, 132, r, *args), 3)
                     for name, args in (("main", ("lpt", "desc", "asc")), ("fa3", ("spt", "asc", "desc")))})
