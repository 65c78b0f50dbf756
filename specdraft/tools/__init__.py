"""Client tools: they drive a running specdraft server over HTTP and measure it (they are not the server).

- ``loadtest``: ``specdraft loadtest``, throughput / TTFT / TPOT with speculation on and off;
- ``soak``: ``specdraft loadtest --soak``, mixed load, greedy answers checked, disconnects, /health;
- ``leak``: ``specdraft leak``, what a stream's timing and sizes tell an observer (normal vs fixed streams);
- ``client``: the prompts and the one timed request that loadtest and soak send.
"""
