; FTIS volunteer client: per-user Windows installer (no admin rights), built on Linux with
; Debian's nsis by packaging/build.py (`make installers`), which passes
;   -DVERSION -DUV_VERSION -DPYTHON_VERSION -DTORCH_VERSION -DSTAGE -DOUTFILE
; STAGE holds uv.exe (from uv's win_amd64 wheel), install.ps1, ftis-launch.py, versions.txt.
;
; The installer lays out those files in %LOCALAPPDATA%\Programs\FTIS Client, then runs
; install.ps1 -PackagesOnly: uv.exe fetches CPython ${PYTHON_VERSION} and ftis-client with the
; PyTorch ${TORCH_VERSION} build that suits the machine (--torch-backend auto).
;
; Silent install: setup.exe /S [/COORDINATOR=HOST:PORT] [/AUTOSTART] [/NOSHORTCUTS]
;   [/SKIPPACKAGES (lay out the files only, for tests)] [/D=C:\install\dir (last)]
; The FTIS_* overrides of install.sh (docs/volunteers.md) reach install.ps1 through the
; environment.

Unicode true
Target amd64-unicode
SetCompressor /SOLID lzma
RequestExecutionLevel user
ManifestDPIAware true

!define APPNAME "FTIS Client"
!define UNINST_KEY "Software\Microsoft\Windows\CurrentVersion\Uninstall\FTIS Client"
!define RUN_KEY "Software\Microsoft\Windows\CurrentVersion\Run"

Name "${APPNAME} ${VERSION}"
OutFile "${OUTFILE}"
InstallDir "$LOCALAPPDATA\Programs\${APPNAME}"
InstallDirRegKey HKCU "Software\${APPNAME}" "InstallDir"
ShowInstDetails show
ShowUninstDetails show
BrandingText "FTIS ${VERSION} (uv ${UV_VERSION}, Python ${PYTHON_VERSION}, torch ${TORCH_VERSION})"
VIProductVersion "${VERSION}.0"
VIAddVersionKey "ProductName" "${APPNAME}"
VIAddVersionKey "ProductVersion" "${VERSION}"
VIAddVersionKey "FileVersion" "${VERSION}"
VIAddVersionKey "FileDescription" "FTIS volunteer client installer"
VIAddVersionKey "LegalCopyright" "FTIS contributors"

!include MUI2.nsh
!include FileFunc.nsh
!include LogicLib.nsh
!include nsDialogs.nsh
!include Sections.nsh

Var Coordinator
Var CoordinatorField
Var SkipPackages

!define MUI_ABORTWARNING
!insertmacro MUI_PAGE_WELCOME
!insertmacro MUI_PAGE_COMPONENTS
Page custom CoordinatorPage CoordinatorLeave
!insertmacro MUI_PAGE_DIRECTORY
!insertmacro MUI_PAGE_INSTFILES
!insertmacro MUI_PAGE_FINISH
!insertmacro MUI_UNPAGE_CONFIRM
!insertmacro MUI_UNPAGE_INSTFILES
!insertmacro MUI_LANGUAGE "English"

Function CoordinatorPage
  !insertmacro MUI_HEADER_TEXT "Coordinator" "The swarm this machine joins"
  nsDialogs::Create 1018
  Pop $R0
  ${NSD_CreateLabel} 0 0 100% 36u "Address (HOST:PORT) of the FTIS coordinator, as given by the project you volunteer for. Leave it empty to keep the current setting (%LOCALAPPDATA%\ftis\ftis\client.env)."
  Pop $R0
  ${NSD_CreateText} 0 40u 100% 12u "$Coordinator"
  Pop $CoordinatorField
  nsDialogs::Show
FunctionEnd

Function CoordinatorLeave
  ${NSD_GetText} $CoordinatorField $Coordinator
FunctionEnd

Section "FTIS Client (required)" SecMain
  SectionIn RO
  SetOutPath "$INSTDIR"
  File "${STAGE}\uv.exe"
  File "${STAGE}\install.ps1"
  File "${STAGE}\ftis-launch.py"
  File "${STAGE}\versions.txt"
  WriteUninstaller "$INSTDIR\uninstall.exe"
  WriteRegStr HKCU "Software\${APPNAME}" "InstallDir" "$INSTDIR"
  WriteRegStr HKCU "Software\${APPNAME}" "Version" "${VERSION}"
  WriteRegStr HKCU "${UNINST_KEY}" "DisplayName" "${APPNAME}"
  WriteRegStr HKCU "${UNINST_KEY}" "DisplayVersion" "${VERSION}"
  WriteRegStr HKCU "${UNINST_KEY}" "Publisher" "FTIS contributors"
  WriteRegStr HKCU "${UNINST_KEY}" "InstallLocation" "$INSTDIR"
  WriteRegStr HKCU "${UNINST_KEY}" "UninstallString" '"$INSTDIR\uninstall.exe"'
  WriteRegStr HKCU "${UNINST_KEY}" "QuietUninstallString" '"$INSTDIR\uninstall.exe" /S'
  WriteRegDWORD HKCU "${UNINST_KEY}" "NoModify" 1
  WriteRegDWORD HKCU "${UNINST_KEY}" "NoRepair" 1

  ; settings of the background client (kept on update and uninstall)
  CreateDirectory "$LOCALAPPDATA\ftis\ftis\node"
  ${IfNot} ${FileExists} "$LOCALAPPDATA\ftis\ftis\client.env"
    ${If} $Coordinator == ""
      StrCpy $R2 "127.0.0.1:7000"
    ${Else}
      StrCpy $R2 $Coordinator
    ${EndIf}
    FileOpen $R1 "$LOCALAPPDATA\ftis\ftis\client.env" w
    FileWrite $R1 "# Settings of the FTIS background client: FTIS_CLIENT_<FLAG> = the flags of$\r$\n"
    FileWrite $R1 "# `ftis-client start`. Written by the installer; kept on update and uninstall.$\r$\n"
    FileWrite $R1 'FTIS_CLIENT_COORDINATOR="$R2"$\r$\n'
    FileWrite $R1 "FTIS_CLIENT_ROUNDS=0$\r$\n"
    FileWrite $R1 'FTIS_CLIENT_OUT="$LOCALAPPDATA\ftis\ftis\node"$\r$\n'
    FileClose $R1
  ${ElseIf} $Coordinator != ""
    FileOpen $R1 "$LOCALAPPDATA\ftis\ftis\client.env" a
    FileSeek $R1 0 END
    FileWrite $R1 'FTIS_CLIENT_COORDINATOR="$Coordinator"$\r$\n'
    FileClose $R1
  ${EndIf}

  ${If} $SkipPackages == 1
    DetailPrint "/SKIPPACKAGES: Python, PyTorch and ftis-client not installed"
  ${Else}
    DetailPrint "uv ${UV_VERSION} installs Python ${PYTHON_VERSION}, PyTorch ${TORCH_VERSION} and ftis-client ${VERSION}"
    DetailPrint "(downloads about 1 GB, 3-4 GB with CUDA; this takes a few minutes)"
    nsExec::ExecToLog '"$SYSDIR\WindowsPowerShell\v1.0\powershell.exe" -NoProfile -NonInteractive -ExecutionPolicy Bypass -File "$INSTDIR\install.ps1" -PackagesOnly -InstallDir "$INSTDIR"'
    Pop $R0
    ${If} $R0 != 0
      MessageBox MB_ICONSTOP "Installing Python and ftis-client failed (exit code $R0); see the details above. Run the installer again to retry." /SD IDOK
      SetErrorLevel 2
      Abort
    ${EndIf}
  ${EndIf}
SectionEnd

Section "Start menu entries" SecShortcuts
  CreateDirectory "$SMPROGRAMS\${APPNAME}"
  CreateShortcut "$SMPROGRAMS\${APPNAME}\FTIS Client.lnk" "$INSTDIR\venv\Scripts\python.exe" '"$INSTDIR\ftis-launch.py" --console'
  CreateShortcut "$SMPROGRAMS\${APPNAME}\FTIS Client (background).lnk" "$INSTDIR\venv\Scripts\pythonw.exe" '"$INSTDIR\ftis-launch.py"'
  CreateShortcut "$SMPROGRAMS\${APPNAME}\Stop FTIS Client.lnk" "$INSTDIR\venv\Scripts\pythonw.exe" '"$INSTDIR\ftis-launch.py" --stop'
  CreateShortcut "$SMPROGRAMS\${APPNAME}\Uninstall FTIS Client.lnk" "$INSTDIR\uninstall.exe"
SectionEnd

Section /o "Start at login (in the background)" SecAutostart
  ; HKCU Run: starts in the user's session, where idle detection and the GPU work
  WriteRegStr HKCU "${RUN_KEY}" "${APPNAME}" '"$INSTDIR\venv\Scripts\pythonw.exe" "$INSTDIR\ftis-launch.py"'
SectionEnd

Section "-size"
  ${GetSize} "$INSTDIR" "/S=0K" $R0 $R1 $R2
  IntFmt $R0 "0x%08X" $R0
  WriteRegDWORD HKCU "${UNINST_KEY}" "EstimatedSize" "$R0"
SectionEnd

Function .onInit
  ${GetParameters} $R0
  ClearErrors
  ${GetOptions} $R0 "/COORDINATOR=" $Coordinator
  ClearErrors
  ${GetOptions} $R0 "/AUTOSTART" $R1
  ${IfNot} ${Errors}
    !insertmacro SelectSection ${SecAutostart}
  ${EndIf}
  ClearErrors
  ${GetOptions} $R0 "/NOSHORTCUTS" $R1
  ${IfNot} ${Errors}
    !insertmacro UnselectSection ${SecShortcuts}
  ${EndIf}
  StrCpy $SkipPackages 0
  ClearErrors
  ${GetOptions} $R0 "/SKIPPACKAGES" $R1
  ${IfNot} ${Errors}
    StrCpy $SkipPackages 1
  ${EndIf}
FunctionEnd

!insertmacro MUI_FUNCTION_DESCRIPTION_BEGIN
  !insertmacro MUI_DESCRIPTION_TEXT ${SecMain} "uv, Python ${PYTHON_VERSION}, PyTorch ${TORCH_VERSION} (CUDA or CPU) and ftis-client ${VERSION}."
  !insertmacro MUI_DESCRIPTION_TEXT ${SecShortcuts} "Start, start in the background, stop and uninstall from the Start menu."
  !insertmacro MUI_DESCRIPTION_TEXT ${SecAutostart} "Start the client in the background when you log in (HKCU Run)."
!insertmacro MUI_FUNCTION_DESCRIPTION_END

Section "Uninstall"
  ${If} ${FileExists} "$INSTDIR\venv\Scripts\pythonw.exe"
    nsExec::Exec '"$INSTDIR\venv\Scripts\pythonw.exe" "$INSTDIR\ftis-launch.py" --stop'
    Pop $R0
  ${EndIf}
  DeleteRegValue HKCU "${RUN_KEY}" "${APPNAME}"
  RMDir /r "$SMPROGRAMS\${APPNAME}"
  RMDir /r "$INSTDIR\venv"
  RMDir /r "$INSTDIR\python"
  RMDir /r "$INSTDIR\cache"
  Delete "$INSTDIR\uv.exe"
  Delete "$INSTDIR\install.ps1"
  Delete "$INSTDIR\ftis-launch.py"
  Delete "$INSTDIR\versions.txt"
  Delete "$INSTDIR\uninstall.exe"
  RMDir "$INSTDIR"
  DeleteRegKey HKCU "${UNINST_KEY}"
  DeleteRegKey HKCU "Software\${APPNAME}"
  ; the node key, checkpoints and settings in %LOCALAPPDATA%\ftis\ftis are kept
SectionEnd
