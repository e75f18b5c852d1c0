from reports.cli import console_main

console_main()
