"""The logview: a small per-user web server showing a job's page, its curves and logs.

    launch.py   find or start the server (no web library imported: the CLI uses it)
    data.py     what a page shows, read from the store and the job folder
    server.py   the aiohttp application and the server's own main loop
    templates/  Jinja2 templates (autoescaped); static/  the page's JS and CSS

The server reads the store and the job folders only; it never talks to a master.
"""
